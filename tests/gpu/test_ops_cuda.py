"""The per-sample ops on CUDA against the same ops on the CPU (the same draws, the same inputs). Marked gpu."""

import pytest
import torch
from torchvision.transforms import v2

from gpufeed import ImageLoader
from gpufeed.augment.ops import SampleOps
from gpufeed.augment.recipe import read_transform

pytestmark = pytest.mark.gpu

HEAD = [v2.RandomResizedCrop(64), v2.RandomHorizontalFlip()]
TAIL = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
PIXEL = [v2.RandomVerticalFlip(0.5), v2.ColorJitter(0.4, 0.4, 0.4, 0.2), v2.RandomGrayscale(0.3),
         v2.GaussianBlur(9, (0.1, 2.0)), v2.RandomAdjustSharpness(2.0, 0.5), v2.TrivialAugmentWide(),
         v2.TrivialAugmentWide(interpolation=v2.InterpolationMode.BILINEAR), v2.RandAugment(), v2.AutoAugment(),
         v2.AugMix(), v2.RandomPerspective(0.6, p=0.7),
         v2.RandomPerspective(0.6, p=0.7, interpolation=v2.InterpolationMode.NEAREST, fill=(10, 200, 30)),
         v2.RandomApply([v2.ColorJitter(0.4), v2.RandomPerspective(p=1.0)], p=0.6),
         v2.RandomChoice([v2.RandomPerspective(p=1.0, fill=None), v2.TrivialAugmentWide(), v2.GaussianBlur(5)]),
         v2.RandomOrder([v2.RandomPerspective(p=1.0), v2.RandomGrayscale(0.5), v2.RandomAdjustSharpness(2.0)])]
IDS = ["vflip", "jitter", "grayscale", "blur", "sharpness", "trivial", "trivial-bilinear", "randaugment", "autoaugment",
       "augmix", "perspective", "perspective-nearest-fill", "random-apply", "random-choice", "random-order"]


@pytest.mark.parametrize("t", PIXEL, ids=IDS)
def test_each_op_gives_the_cpus_pixels_on_cuda(t):
    """256 samples, each with its own draws: within one level of the CPU's pixels, and those rarely (a sum
    in another order landing on the other side of a level)."""
    op = read_transform(v2.Compose(HEAD + [t])).pixel[0]
    images = torch.randint(0, 256, (256, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    choices = SampleOps.draws(op, range(256), seed=2, epoch=0, size=64)
    cpu = op.apply(images, choices)
    cuda = op.apply(images.cuda(), choices)
    assert cuda.device.type == "cuda" and cuda.dtype == torch.uint8 and cuda.shape == cpu.shape
    diff = (cuda.cpu().int() - cpu.int()).abs()
    assert float(diff.float().mean()) <= 1 / 255 and float((diff > 1).float().mean()) < 1e-3, int(diff.max())


def test_a_loader_with_every_op_gives_on_cuda_what_the_cpu_gives(tmp_path):
    """The whole recipe (every pixel op, RandomErasing) through ImageLoader on CUDA, twice with one seed (the
    same bits), and the per-sample ops on the CPU from the same batch before them (close: the ops' sums in
    another order)."""
    from gpufeed.synth import create_synthetic_dataset

    root = create_synthetic_dataset(tmp_path, n=64, num_classes=4, seed=3, workers=2)
    pipeline = v2.Compose(HEAD + [PIXEL[i] for i in (0, 1, 2, 3, 4, 5, 8)] + TAIL + [v2.RandomErasing(p=0.5)])
    kw = dict(batch_size=16, device="cuda", num_workers=2, seed=5)
    a, b = ImageLoader(root, transform=pipeline, **kw), ImageLoader(root, transform=pipeline, **kw)
    plain = ImageLoader(root, transform=v2.Compose(HEAD + TAIL), **kw)
    ops = a.sample_ops
    assert a.stats["auto_augment_ops"].startswith("two Triton kernels") and plain.stats["auto_augment_ops"] is None
    compared = 0
    for (xa, _), (xb, _), (xp, _) in zip(a, b, plain, strict=True):
        assert xa.shape == (16, 3, 64, 64) and xa.is_cuda and torch.equal(xa, xb)
        on_cpu = ops(xp.cpu(), plain.batch_indices, 5, 0)
        assert float((xa.cpu() - on_cpu).abs().mean()) < 0.02
        compared += 1
    assert compared == 4
    for loader in (a, b, plain):
        loader.close()


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest"])
def test_perspective_gives_torchvisions_cuda_pixels_for_each_samples_corners(interpolation):
    """64 samples warped on CUDA in one batch against torchvision's ``perspective`` on CUDA for each: the
    same grid and fill arithmetic, so nearly every pixel the same (a batched product may round a coordinate's
    last bit otherwise, moving a nearest sample or a bilinear sum by a level)."""
    from torchvision.transforms.v2 import functional as F

    from gpufeed.augment.ops import Perspective

    op = Perspective(0.7, p=1.0, interpolation=interpolation, fill=(10.0, 200.0, 30.0))
    images = torch.randint(0, 256, (64, 3, 48, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    images = images.cuda()
    choices = SampleOps.draws(op, range(64), seed=1, epoch=0, size=48)
    ours = op.apply(images, choices)
    start = [[0, 0], [47, 0], [47, 47], [0, 47]]
    theirs = torch.stack([F.perspective(image, start, [list(c) for c in corners], interpolation=v2.InterpolationMode(
        interpolation), fill=[10.0, 200.0, 30.0]) for image, corners in zip(images, choices, strict=True)])
    assert ours.is_cuda and ours.shape == theirs.shape
    diff = (ours.int() - theirs.int()).abs()
    assert float((diff > 0).float().mean()) < 1e-3 and float(diff.float().mean()) < 0.05, int(diff.max())


def test_a_cuda_loader_runs_perspective_and_the_containers_on_the_device(tmp_path):
    """RandomPerspective and the three containers in a CUDA loader: listed in ``ops_on_device``, none in the
    workers (the GPU decode path stays), the same bits twice with one seed, and close to the same ops run on
    the CPU from the plain batch."""
    from gpufeed.synth import create_synthetic_dataset

    root = create_synthetic_dataset(tmp_path, n=64, num_classes=4, seed=3, workers=2)
    pipeline = v2.Compose(HEAD + [PIXEL[10], *PIXEL[12:]] + TAIL)
    kw = dict(batch_size=16, device="cuda", num_workers=2, seed=5)
    a, b = ImageLoader(root, transform=pipeline, **kw), ImageLoader(root, transform=pipeline, **kw)
    plain = ImageLoader(root, transform=v2.Compose(HEAD + TAIL), **kw)
    assert a.stats["ops_on_device"] == ["RandomPerspective", "RandomApply", "RandomChoice", "RandomOrder"]
    assert a.stats["ops_in_workers"] == [] and a.decode_backend == plain.decode_backend
    compared = 0
    for (xa, _), (xb, _), (xp, _) in zip(a, b, plain, strict=True):
        assert xa.shape == (16, 3, 64, 64) and xa.is_cuda and torch.equal(xa, xb)
        on_cpu = a.sample_ops(xp.cpu(), plain.batch_indices, 5, 0)
        assert float((xa.cpu() - on_cpu).abs().mean()) < 0.05
        compared += 1
    assert compared == 4
    for loader in (a, b, plain):
        loader.close()


def test_autocontrast_and_equalize_give_torchvisions_pixels_on_cuda():
    """The batched passes on CUDA against torchvision's ops on the CPU, exactly: channels of one value, of a
    narrow range, of the full range, and with all but a few pixels at the brightest (equalize left as is)."""
    from torchvision.transforms.v2 import functional as F

    from gpufeed.augment.ops import pixels

    g = torch.Generator().manual_seed(6)
    images = torch.randint(0, 256, (64, 3, 48, 48), dtype=torch.uint8, generator=g)
    images[0:16] = images[0:16] // 16 + 100  # narrow
    images[16:24, 1] = 77  # one value
    images[24:32] = 250
    images[24:32, :, 0, :10] = 3  # a step of 0
    compared = 0
    for ours, theirs in ((pixels.autocontrast, F.autocontrast), (pixels.equalize, F.equalize)):
        assert torch.equal(ours(images.cuda()).cpu(), theirs(images))
        compared += 1
    assert compared == 2


def test_the_triton_kernels_give_the_pytorch_passes_pixels_on_cuda():
    """Every colour and point operation of the auto-augment family through the Triton kernels and through the
    PyTorch passes on CUDA, at 3 x 3 (nothing to sharpen), 6 x 9, 33 x 31 (two tiles, padded lanes), 64 x 64
    and 224 x 224: the same pixels."""
    pytest.importorskip("triton")
    from gpufeed.augment.ops import kernels

    from ..test_ops_kernels import check, compare

    assert kernels.usable(torch.zeros(1, device="cuda")), kernels.describe()
    sizes = ((3, 3), (6, 9), (33, 31), (64, 64), (224, 224))
    result = compare("cuda", sizes)
    print(result)
    check(result, sizes)


def test_pixel_ops_start_from_the_gpu_stages_crops_each_the_nearest_level(tmp_path):
    """With pixel ops the GPU stage hands over uint8 crops (rounded, not normalised and taken back): an op
    that changes nothing (RandomVerticalFlip(p=0)) gives the plain loader's batch within half a level."""
    from gpufeed.synth import create_synthetic_dataset

    root = create_synthetic_dataset(tmp_path, n=48, num_classes=4, seed=3, workers=2)
    kw = dict(batch_size=16, device="cuda", num_workers=2, seed=5, decode="auto", cpu_share=0.0)  # one decoder
    with_op = ImageLoader(root, transform=v2.Compose(HEAD + [v2.RandomVerticalFlip(0.0)] + TAIL), **kw)
    plain = ImageLoader(root, transform=v2.Compose(HEAD + TAIL), **kw)
    assert with_op.decode_backend != "cpu", with_op.decode_reason
    half_level = 0.5 / (255 * 0.224) + 1e-4
    compared = 0
    for (xa, _), (xp, _) in zip(with_op, plain, strict=True):
        assert xa.dtype == xp.dtype == torch.float32 and xa.is_cuda
        diff = (xa - xp).abs()
        assert float(diff.max()) <= half_level and float(diff.max()) > 0
        compared += 1
    assert compared == 3
    for loader in (with_op, plain):
        loader.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pixel_ops_on_the_cpu_paths_crops_on_cuda_give_the_plain_loaders_bits(tmp_path, dtype):
    """decode="cpu" on CUDA with pixel ops: the workers' uint8 crops go to the ops unnormalised, and an op
    that changes nothing gives the plain loader's batch bit for bit, in its dtype and channels_last."""
    from gpufeed.synth import create_synthetic_dataset

    root = create_synthetic_dataset(tmp_path, n=40, num_classes=4, seed=3, workers=2)
    tail = [v2.ToImage(), v2.ToDtype(dtype, scale=True), TAIL[-1]]
    kw = dict(batch_size=16, device="cuda", num_workers=2, seed=5, decode="cpu", channels_last=True)
    with_op = ImageLoader(root, transform=v2.Compose(HEAD + [v2.RandomVerticalFlip(0.0)] + tail), **kw)
    plain = ImageLoader(root, transform=v2.Compose(HEAD + tail), **kw)
    compared = 0
    for (xa, _), (xp, _) in zip(with_op, plain, strict=True):
        assert xa.dtype == dtype and xa.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(xa, xp)
        compared += 1
    assert compared == 2  # 40 samples, the last part batch dropped
    for loader in (with_op, plain):
        loader.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_normalising_kernel_gives_the_pytorch_passes_bits_on_cuda(monkeypatch, dtype):
    """``SampleOps.from_pixels`` through the Triton kernel and with ``GPUFEED_OPS_KERNELS=0`` (the PyTorch
    passes) on the GPU, where fused multiply-adds and the GPU's conversions could differ: the same bits (as
    integers) and strides, channels_last and contiguous, with ImageNet's constants and others."""
    from gpufeed.augment.ops import kernels

    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.delenv("GPUFEED_OPS_KERNELS", raising=False)
    calls, launch = [], kernels.normalize
    monkeypatch.setattr(kernels, "normalize", lambda *args: calls.append(1) or launch(*args))
    pixels = torch.randint(0, 256, (32, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    pixels = pixels.cuda()
    as_int = torch.int32 if dtype == torch.float32 else torch.int16
    for mean, std in (((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), ((0.5, 0.3, 0.1), (0.21, 0.7, 0.05))):
        ops = SampleOps(mean=mean, std=std)
        for channels_last in (True, False):
            ours = ops.from_pixels(pixels, range(32), 0, 0, dtype=dtype, channels_last=channels_last)
            monkeypatch.setenv("GPUFEED_OPS_KERNELS", "0")
            passes = ops.from_pixels(pixels, range(32), 0, 0, dtype=dtype, channels_last=channels_last)
            monkeypatch.delenv("GPUFEED_OPS_KERNELS")
            assert ours.dtype == passes.dtype == dtype and ours.stride() == passes.stride()
            assert int((ours.view(as_int) != passes.view(as_int)).sum()) == 0 and ours.numel() == 32 * 3 * 224 * 224
    assert len(calls) == 4 and kernels._failed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_mixup_kernel_gives_the_pytorch_passes_bits_on_cuda(monkeypatch, dtype):
    """``BatchMix.apply``'s MixUp through the Triton kernel (a new batch) and with ``GPUFEED_OPS_KERNELS=0``
    (the PyTorch passes, in place) on the GPU: the same bits (as integers) and strides, in both layouts."""
    from gpufeed.augment.mix import BatchMix, Mix
    from gpufeed.augment.ops import kernels

    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.delenv("GPUFEED_OPS_KERNELS", raising=False)
    calls, launch = [], kernels.mixup
    monkeypatch.setattr(kernels, "mixup", lambda *args: calls.append(1) or launch(*args))
    mix = BatchMix((("MixUp", 1.0),), (1.0,), num_classes=10)
    labels = torch.arange(32, device="cuda") % 10
    as_int = torch.int32 if dtype == torch.float32 else torch.int16
    g = torch.Generator().manual_seed(5)
    for fmt in (torch.channels_last, torch.contiguous_format):
        for lam in (0.3, 0.123456789, 1.0):
            images = (torch.randn(32, 3, 224, 224, generator=g) * 3).to("cuda", dtype).contiguous(memory_format=fmt)
            ours, _ = mix.apply(images, labels, Mix("MixUp", lam), fresh=True)
            monkeypatch.setenv("GPUFEED_OPS_KERNELS", "0")
            passes, _ = mix.apply(images.clone(memory_format=torch.preserve_format), labels, Mix("MixUp", lam),
                                   fresh=True)
            monkeypatch.delenv("GPUFEED_OPS_KERNELS")
            assert ours.data_ptr() != images.data_ptr() and ours.stride() == passes.stride() == images.stride()
            assert int((ours.view(as_int) != passes.view(as_int)).sum()) == 0 and ours.numel() == 32 * 3 * 224 * 224
    assert len(calls) == 6 and kernels._failed is None
