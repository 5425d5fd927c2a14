"""Every ```python block of README.md, run as written on tiny generated data on the CPU.

What makes a snippet run here is declared once, below: ``SUBSTITUTIONS`` (text replaced in every snippet:
the README's paths become generated data, the GPU the CPU, batches small, one epoch, the S3 bucket and
endpoint a local S3 server's), ``GIVEN`` (names a snippet takes as the reader's own, such as ``model``) and
``NO_GPU`` (what ``torch.cuda`` answers while a snippet runs, so that ``device="auto"`` and Lightning's
accelerator pick the CPU on a GPU machine too).
Each snippet runs in a fresh namespace, in this process, in README order; none builds on another's names.
A snippet that raises fails its test, and so does a substitution that no snippet contains any more (the
README changed under it), or a README without Python snippets.
"""

from __future__ import annotations

import gc
import re
import string
from pathlib import Path

import pytest
import torch

from gpufeed.sources import folder_source
from gpufeed.synth import create_synthetic_dataset, tar_shards

README = Path(__file__).resolve().parents[1] / "README.md"

# README text -> what runs here; ${...} are the generated data and the local S3 server (``places``)
SUBSTITUTIONS = {
    '"/tmp/d"': '"${train}"',
    '"/data/imagenet/train"': '"${train}"',
    '"/data/imagenet/val"': '"${val}"',
    '"/data/train.csv"': '"${filelist}"',
    'device="cuda"': 'device="cpu"',
    "batch_size=256": "batch_size=8",
    "epochs = 90": "epochs = 1",
    "max_epochs=90": "max_epochs=1",
    "s3://my-bucket/train/shard-{000000..000127}.tar": "s3://data/train/shard-{000..007}.tar",
    "https://minio.example.com": "${endpoint}",
}


def _tiny_lightning_module():
    import lightning as L

    class Tiny(L.LightningModule):
        """A linear classifier on 4 x 4 pooled images: any image size, any number of classes up to 4."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3 * 4 * 4, 4)

        def _loss(self, batch):
            images, labels = batch
            return torch.nn.functional.cross_entropy(self.layer(torch.nn.functional.adaptive_avg_pool2d(images, 4)
                                                                .flatten(1)), labels)

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


# names a snippet uses as the reader's own: made only for the snippets that use them
GIVEN = {"model": _tiny_lightning_module}

# torch.cuda as a machine without a GPU answers it
NO_GPU = {"is_available": lambda: False, "device_count": lambda: 0}


def _snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


SNIPPETS = _snippets()


def test_the_readme_has_snippets_and_every_substitution_still_applies():
    assert len(SNIPPETS) >= 3, "README.md has no ```python snippets left to run"
    unused = [old for old in SUBSTITUTIONS if not any(old in s for s in SNIPPETS)]
    assert not unused, f"substitutions no README snippet contains any more: {unused}"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """40 JPEGs in 4 classes as an ImageFolder (training and validation), and as a "path,label" file list."""
    root = create_synthetic_dataset(tmp_path_factory.mktemp("readme") / "train", n=40, num_classes=4, seed=0,
                                    workers=1)
    source = folder_source(root)
    filelist = root.parent / "train.csv"
    filelist.write_text("".join(f"{source.path(i)},{source.label(i)}\n" for i in range(len(source))))
    return {"train": str(root), "val": str(root), "filelist": str(filelist)}


@pytest.fixture(scope="module")
def s3(data):
    """The 40 images as 8 WebDataset shards of 5 at s3://data/train/shard-000.tar ... shard-007.tar."""
    from .servers import S3Server

    server = S3Server()
    server.bucket("data")
    for s, shard in enumerate(tar_shards(folder_source(data["train"]), 5)):
        server.put("data", f"train/shard-{s:03d}.tar", shard)
    yield server
    server.stop()


def _runnable(snippet: str, places: dict[str, str]) -> str:
    for old, new in SUBSTITUTIONS.items():
        snippet = snippet.replace(old, string.Template(new).safe_substitute(places))
    return snippet


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_the_readme_snippet_runs(snippet, data, request, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a snippet writes (Lightning's logs and checkpoints) lands here
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))  # the shard index, for this test alone
    for name, answer in NO_GPU.items():
        monkeypatch.setattr(torch.cuda, name, answer)
    places = dict(data)
    if "s3://" in snippet:  # credentials come the usual way, from the environment
        server = request.getfixturevalue("s3")
        places["endpoint"] = server.endpoint
        for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
    code = _runnable(snippet, places)
    namespace = {"__name__": "__readme__"}
    namespace.update({name: make() for name, make in GIVEN.items() if re.search(rf"\b{name}\b", code)})
    try:
        exec(compile(code, f"README.md snippet {SNIPPETS.index(snippet)}", "exec"), namespace)
    finally:  # loaders a snippet left open stop their workers now, not at the end of the run
        for value in list(namespace.values()):
            if type(value).__name__ == "ImageLoader":
                value.close()
        namespace.clear()
        gc.collect()
