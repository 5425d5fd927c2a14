"""Every ```python block of README.md and docs/*.md, run as written on tiny generated data on the CPU.

What makes a snippet run here is declared once, below: ``SUBSTITUTIONS`` (text replaced in every snippet:
the documents' paths become generated data, the GPU the CPU, batches small, one epoch, the S3 bucket and
endpoint a local S3 server's), ``GIVEN`` (names a snippet takes as the reader's own, such as ``model``) and
``NO_GPU`` (what ``torch.cuda`` answers while a snippet runs, so that ``device="auto"`` and Lightning's
accelerator pick the CPU on a GPU machine too).

Each snippet runs as the reader's script would: written to a file and run as the module ``__main__`` (so a
process it starts imports it again, as it would the script), in this process, in a fresh namespace; none
builds on another's names. A snippet that needs what CI has not (GPUs, torchrun) says so in its document, on
the line before its fence: ``<!-- not run in CI: the reason -->``; it is compiled and its imports run, not the
rest. Every snippet reads only names it defines, builtins and ``GIVEN``'s. A snippet that fails fails its
test, and so does a substitution that no snippet contains any more (a document changed under it).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import gc
import re
import string
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gpufeed.sources import folder_source
from gpufeed.synth import create_synthetic_dataset, tar_shards

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# document text -> what runs here; ${...} are the generated data and the local S3 server (``places``)
SUBSTITUTIONS = {
    '"/tmp/d"': '"${train}"',
    '"/data/imagenet/train"': '"${train}"',
    '"/data/imagenet/val"': '"${val}"',
    '"/data/train.csv"': '"${filelist}"',
    '"/data/imagenet-320"': '"imagenet-320"',  # in the snippet's own folder
    'device="cuda"': 'device="cpu"',
    "batch_size=256": "batch_size=8",
    '{"batch_size": 512}': '{"batch_size": 8}',
    "epochs = 90": "epochs = 1",
    "max_epochs=90": "max_epochs=1",
    "every_n_train_steps=1000": "every_n_train_steps=2",  # a checkpoint inside the tiny epoch
    "s3://my-bucket/train/shard-{000000..000127}.tar": "s3://data/train/shard-{000..007}.tar",
    "s3://bucket/train/": "s3://data/train/",
    "https://minio.example.com": "${endpoint}",
    "http://minio:9000": "${endpoint}",
}


def _tiny_lightning_module():
    import lightning as L

    class Tiny(L.LightningModule):
        """A linear classifier on 4 x 4 pooled images: any image size, any number of classes up to 4.
        ``steps`` counts the training steps it took."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3 * 4 * 4, 4)
            self.steps = 0

        def _loss(self, batch):
            images, labels = batch
            return torch.nn.functional.cross_entropy(self.layer(torch.nn.functional.adaptive_avg_pool2d(images, 4)
                                                                .flatten(1)), labels)

        def training_step(self, batch, batch_idx):
            self.steps += 1
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

NOT_RUN = "<!-- not run in CI: "


@dataclass(frozen=True)
class Snippet:
    document: str  # its path in the repository
    line: int  # of its first line of code
    code: str
    not_run: str | None  # why CI cannot run it, from the document; None: it runs

    def __str__(self) -> str:
        return f"{self.document}:{self.line}"


def _snippets() -> list[Snippet]:
    found = []
    for path in DOCUMENTS:
        text = path.read_text()
        for m in re.finditer(r"^(?:<!-- not run in CI: (?P<why>.*?) -->\n)?```python\n(?P<code>.*?)^```", text,
                             flags=re.S | re.M):
            line = text.count("\n", 0, m.start("code")) + 1
            found.append(Snippet(str(path.relative_to(ROOT)), line, m["code"], m["why"]))
    return found


SNIPPETS = _snippets()


def test_the_documents_have_snippets_and_every_substitution_still_applies():
    documents = {s.document for s in SNIPPETS}
    assert "README.md" in documents and len(documents) >= 3, f"Python snippets found only in {sorted(documents)}"
    unused = [old for old in SUBSTITUTIONS if not any(old in s.code for s in SNIPPETS)]
    assert not unused, f"substitutions no snippet contains any more: {unused}"


def test_a_snippet_marked_not_run_says_why_and_the_marker_stands_right_before_its_fence():
    for path in DOCUMENTS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith(NOT_RUN):
                where = f"{path.relative_to(ROOT)}:{i + 1}"
                assert line.endswith(" -->") and len(line) > len(NOT_RUN) + 15, f"{where}: give the reason: {line}"
                assert i + 1 < len(lines) and lines[i + 1] == "```python", f"{where}: no ```python fence after it"


def _unbound_names(code: str) -> set[str]:
    """Names the code reads that it never binds (an import, an assignment, a loop or ``with`` target, a
    definition), builtins apart."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound


@pytest.mark.parametrize("snippet", SNIPPETS, ids=str)
def test_the_snippet_is_complete(snippet):
    """It compiles, its imports import, and every name it reads is its own, a builtin or a given one."""
    code = compile(snippet.code, str(snippet), "exec", flags=ast.PyCF_ONLY_AST)
    imports = ast.Module([node for node in code.body if isinstance(node, (ast.Import, ast.ImportFrom))], [])
    exec(compile(imports, f"the imports of {snippet}", "exec"), {})
    unbound = _unbound_names(snippet.code) - set(GIVEN)
    assert not unbound, f"{snippet} reads names it never defines or imports: {sorted(unbound)}"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """40 JPEGs in 4 classes as an ImageFolder (training and validation), and as a "path,label" file list."""
    root = create_synthetic_dataset(tmp_path_factory.mktemp("docs") / "train", n=40, num_classes=4, seed=0,
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


@pytest.fixture()
def places(data, tmp_path, monkeypatch):
    """What ``${...}`` stands for, with the snippet's folder the working directory (what it writes lands there),
    the shard index its own and ``torch.cuda`` answering as without a GPU."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))
    for name, answer in NO_GPU.items():
        monkeypatch.setattr(torch.cuda, name, answer)
    return dict(data)


def _with_s3(snippet: Snippet, places: dict, request, monkeypatch) -> dict:
    if "s3://" not in snippet.code:
        return places
    server = request.getfixturevalue("s3")
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # credentials the usual way, from the environment
        monkeypatch.setenv(name, value)
    return {**places, "endpoint": server.endpoint}


@contextlib.contextmanager
def _as_main(path: Path):
    """A fresh module ``__main__`` whose file is ``path``, as ``python path`` would make it."""
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        yield module
    finally:
        sys.modules["__main__"] = saved


def _run(snippet: Snippet, places: dict[str, str]) -> dict:
    """Runs the snippet as a script in the working directory; returns the GIVEN objects it was handed."""
    code = snippet.code
    for old, new in SUBSTITUTIONS.items():
        code = code.replace(old, string.Template(new).safe_substitute(places))
    path = Path.cwd() / (re.sub(r"\W", "_", str(snippet)) + ".py")
    path.write_text(code)
    given = {name: make() for name, make in GIVEN.items() if re.search(rf"\b{name}\b", code)}
    with _as_main(path) as main:
        namespace = main.__dict__
        namespace.update(given)
        try:
            exec(compile(code, str(path), "exec"), namespace)
        finally:  # loaders a snippet left open stop their workers now, not at the end of the run
            for value in list(namespace.values()):
                if type(value).__name__ == "ImageLoader":
                    value.close()
            namespace.clear()
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()  # Lightning's "ddp" keeps its group until exit
            gc.collect()
    return given


RUN = [s for s in SNIPPETS if s.not_run is None]


@pytest.mark.parametrize("snippet", RUN, ids=str)
def test_the_snippet_runs(snippet, places, request, monkeypatch):
    _run(snippet, _with_s3(snippet, places, request, monkeypatch))


def test_the_readme_lightning_snippet_run_again_goes_on_from_its_checkpoint(places, tmp_path):
    """Run twice in one folder, as a job restarted after a stop: the second run starts from the checkpoint the
    first wrote and trains exactly the steps after it."""
    (snippet,) = [s for s in RUN if s.document == "README.md" and "ckpt_path=" in s.code]
    first = _run(snippet, places)["model"]
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_file(), f"{snippet} wrote no {last.relative_to(tmp_path)}"
    saved_at = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 0 < saved_at < first.steps, (saved_at, first.steps)  # a checkpoint inside the epoch
    second = _run(snippet, places)["model"]
    assert second.steps == first.steps - saved_at
