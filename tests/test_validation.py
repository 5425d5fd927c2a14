"""Validation crops reproduce torchvision's Resize(256) + CenterCrop(224) + ToTensor + Normalize on the same
files: landscape, portrait, square, smaller than the crop, and large enough for DCT-domain shrinking."""

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
# The README's figures for these images, one decimal each ("43.5 dB at the least, 84.7 median"): the lowest
# values those roundings stand for. These images give 43.50 and 84.66; Pillow's HAMMING filter in place of
# its bilinear one, 34.7 and 39.3.
MIN_DB, MEDIAN_DB = 43.45, 84.65


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
            img = img.resize((img.width * 3, img.height * 3))  # large: shrunk in the DCT domain first
        img.save(root / "c" / f"{i:02d}.jpg", quality=92)
    return root


def _torchvision(root):
    t = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    return torch.stack([t(Image.open(p).convert("RGB")) for p in sorted((root / "c").glob("*.jpg"))])


def _pixels(x):
    m, s = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return ((x.float().cpu() * s + m) * 255).numpy()


def _scores(loader, reference):
    (images, labels), = list(loader)
    got, want = _pixels(images), _pixels(reference)
    assert len(got) == len(want) == 24
    return [psnr(got[i], want[i]) for i in range(24)]


def _assert_as_the_readme_states(scores, what):
    print(f"validation PSNR against torchvision, {what}: min {min(scores):.2f} median {np.median(scores):.2f} dB")
    assert len(scores) == 24
    assert min(scores) >= MIN_DB and np.median(scores) >= MEDIAN_DB, (f"min {min(scores):.2f} median "
                                                                      f"{np.median(scores):.2f}", sorted(scores)[:4])


def test_validation_matches_torchvision(shapes):
    ref = _torchvision(shapes)
    with ImageLoader(shapes, train=False, batch_size=24, device="cpu", num_workers=2, drop_last=False) as loader:
        scores = _scores(loader, ref)
        assert loader.decode_backend == "cpu"
    _assert_as_the_readme_states(scores, "cpu")


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
def test_a_torchvision_validation_pipeline_given_as_transform_matches_torchvision(shapes, mean, std):
    """``transform=`` with the script's own Resize + CenterCrop + ToTensor + Normalize: the same pixels as
    that pipeline run by torchvision, with its mean and std."""
    pipeline = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(mean, std)])
    ref = torch.stack([pipeline(Image.open(p).convert("RGB")) for p in sorted((shapes / "c").glob("*.jpg"))])
    with ImageLoader(shapes, transform=pipeline, batch_size=24, device="cpu", num_workers=2, drop_last=False) as loader:
        assert not loader.augment.train and (loader.normalize.mean, loader.normalize.std) == (mean, std)
        (images, _), = list(loader)
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    got, want = ((images * s + m) * 255).numpy(), ((ref * s + m) * 255).numpy()
    _assert_as_the_readme_states([psnr(got[i], want[i]) for i in range(24)], f"transform= with mean {mean}")
