"""Validation crops reproduce torchvision's Resize(256) + CenterCrop(224) + ToTensor + Normalize on the same
files: landscape, portrait, square, smaller than the crop, and 3x larger (decoded whole all the same)."""

import io

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from gpufeed import ImageLoader
from gpufeed.synth import synthetic_jpeg
from tests.helpers import psnr

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("val")
    (root / "c").mkdir()
    for i in range(24):
        img = Image.open(io.BytesIO(synthetic_jpeg(np.random.default_rng([11, i]))[0])).convert("RGB")
        kind = i % 6
        if kind == 1:
            img = img.transpose(Image.Transpose.ROTATE_90)  # portrait
        elif kind == 2:
            img = img.crop((0, 0, min(img.size), min(img.size)))  # square
        elif kind == 3:
            img = img.resize((img.width * 2 // 5, img.height * 2 // 5))  # smaller than the crop
        elif kind == 4:
            img = img.resize((img.width * 3, img.height * 3))  # large: 3x what the resize keeps
        img.save(root / "c" / f"{i:02d}.jpg", quality=92)
    return root


def _torchvision(root):
    t = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    return torch.stack([t(Image.open(p).convert("RGB")) for p in sorted((root / "c").glob("*.jpg"))])


def _pixels(x, mean=MEAN, std=STD):
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    return ((x.float().cpu() * s + m) * 255).numpy()


def _levels(x, mean=MEAN, std=STD):
    """(B, 3, S, S) normalised float back to the uint8 levels it was made from."""
    return np.rint(_pixels(x, mean, std)).clip(0, 255).astype(np.uint8)


def _scores(loader, reference):
    (images, labels), = list(loader)
    got, want = _pixels(images), _pixels(reference)
    assert len(got) == len(want) == 24
    return [psnr(got[i], want[i]) for i in range(24)]


def _assert_equal_levels(got, want, what):
    """Every pixel of the 24 crops the same uint8 level as torchvision's; the first unequal image named."""
    assert got.shape == want.shape == (24, 3, 224, 224), (got.shape, want.shape)
    unequal = [i for i in range(24) if not np.array_equal(got[i], want[i])]
    assert not unequal, (what, unequal, [int(np.abs(got[i].astype(int) - want[i]).max()) for i in unequal])


def test_validation_gives_torchvisions_pixels(shapes):
    """The CPU path: the workers' crops are torchvision's, level for level, large images included."""
    ref = _torchvision(shapes)
    with ImageLoader(shapes, train=False, batch_size=24, device="cpu", num_workers=2, drop_last=False) as loader:
        (images, _), = list(loader)
        assert loader.decode_backend == "cpu"
    _assert_equal_levels(_levels(images), _levels(ref), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("cpu_share", [0.0, 0.5])
def test_validation_on_cuda_decodes_on_the_gpu_and_matches_torchvision(shapes, cpu_share):
    """train=False on CUDA: the GPU decoders and the CPU workers share each batch, as for training; the
    device's Resize + CenterCrop (augment.center_crop) is Pillow's arithmetic, so the pixels differ from
    torchvision's only where the decoders do: at least 40 dB for every image, 50 at the median."""
    ref = _torchvision(shapes)
    with ImageLoader(shapes, train=False, batch_size=24, device="cuda", num_workers=2, drop_last=False,
                     cpu_share=cpu_share) as loader:
        scores = _scores(loader, ref)
        assert loader.decode_backend != "cpu", loader.decode_reason
        by = loader.stats["decoded_by"]
        # four of the images have a side over 1024 pixels: the CPU workers finish those
        assert by.get(f"gpu:{loader.decode_backend}", 0) >= (8 if cpu_share else 20), by
    print(f"validation PSNR against torchvision, cuda, cpu_share={cpu_share}: min {min(scores):.2f} "
          f"median {np.median(scores):.2f} dB")
    assert min(scores) >= 40 and np.median(scores) >= 50, sorted(scores)[:4]


@pytest.mark.parametrize("mean, std", [(MEAN, STD), ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))])
def test_a_torchvision_validation_pipeline_given_as_transform_gives_its_pixels(shapes, mean, std):
    """``transform=`` with the script's own Resize + CenterCrop + ToTensor + Normalize: the same pixels as
    that pipeline run by torchvision, with its mean and std."""
    pipeline = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(mean, std)])
    ref = torch.stack([pipeline(Image.open(p).convert("RGB")) for p in sorted((shapes / "c").glob("*.jpg"))])
    with ImageLoader(shapes, transform=pipeline, batch_size=24, device="cpu", num_workers=2, drop_last=False) as loader:
        assert not loader.augment.train and (loader.normalize.mean, loader.normalize.std) == (mean, std)
        (images, _), = list(loader)
    _assert_equal_levels(_levels(images, mean, std), _levels(ref, mean, std), f"transform= with mean {mean}")


def test_a_validation_batch_none_of_whose_files_decode_is_not_yielded(tmp_path):
    """on_error="skip", CPU path: the second of three batches holds only broken files. The loop gets the first
    and the third, torchvision's pixels with their labels, never an empty batch; the four files are counted
    and listed as skipped, and the sampler's position covers them (the epoch ends where it should)."""
    from tests.helpers import textured

    paths = []
    for c in range(2):
        (tmp_path / f"c{c}").mkdir()
        for i in range(6):
            paths.append(tmp_path / f"c{c}" / f"{i}.jpg")
            textured(70 + 13 * i, 60 + 7 * c, 10 * c + i, ((200, 60, 40), (40, 60, 200))[c]).save(paths[-1], quality=90)
    bad = paths[4:8]  # c0/4, c0/5, c1/0, c1/1: the whole second batch
    for p in bad:
        p.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    good = [p for p in paths if p not in bad]
    t = T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor(), T.Normalize(MEAN, STD)])
    with ImageLoader(tmp_path, train=False, image_size=32, resize_size=40, batch_size=4, device="cpu",
                     num_workers=2, drop_last=False, on_error="skip") as loader:
        assert len(loader) == 3
        got = [(x, y, list(loader.batch_indices)) for x, y in loader]
        assert [len(y) for _, y, _ in got] == [4, 4]
        assert [i for _, _, idx in got for i in idx] == [0, 1, 2, 3, 8, 9, 10, 11]
        assert torch.cat([y for _, y, _ in got]).tolist() == [0] * 4 + [1] * 4
        want = torch.stack([t(Image.open(p).convert("RGB")) for p in good])
        levels = _levels(torch.cat([x for x, _, _ in got]))
        assert np.array_equal(levels, _levels(want))
        assert sorted(p for p, _ in loader.stats["skipped"]) == sorted(str(p) for p in bad)
        assert loader.sampler.epoch == 1  # the epoch ran to its end: the next one is up
