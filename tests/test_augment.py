import io
import math

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as F
from PIL import Image

from gpufeed.decode.crop import crop_resize_into, reduction_for
from gpufeed.augment.normalize import IMAGENET_MEAN, IMAGENET_STD, Normalize
from gpufeed.augment.params import AugmentSpec, CropBox, SampleRandom
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.synth import synthetic_jpeg
from tests.helpers import psnr
from tests.stats import assert_same_distribution, assert_same_frequencies


def test_sample_random_is_deterministic_and_uniform():
    a = [SampleRandom(1, 2, i).uniform() for i in range(2000)]
    assert a == [SampleRandom(1, 2, i).uniform() for i in range(2000)]
    assert a != [SampleRandom(1, 3, i).uniform() for i in range(2000)]
    assert 0 <= min(a) and max(a) < 1 and abs(np.mean(a) - 0.5) < 0.03


@pytest.mark.parametrize("ahead", [0, 1, 8, 16])
def test_streams_computed_ahead_give_each_samples_own_numbers(ahead):
    """A batch's streams, their first uniforms computed at once, give exactly what each sample's own
    SampleRandom gives, past the uniforms computed ahead too, through every kind of draw; for seeds and
    epochs beyond 64 bits or negative (masked, as the scalar generator masks them)."""
    import random

    rng, compared = random.Random(ahead), 0
    for seed, epoch in [(0, 0), (1, 3), (-5, 2), (rng.getrandbits(70), rng.getrandbits(20)), (0x7A1B_0001 ^ 9, 1)]:
        indices = [0, 1, 7] + [rng.randrange(1 << 40) for _ in range(30)]
        streams = SampleRandom.streams(seed, epoch, indices, ahead)
        assert len(streams) == len(indices)
        for i, fast in zip(indices, streams):
            one = SampleRandom(seed, epoch, i)
            for low, high in [(0.0, 1.0)] * 4 + [(0.02, 0.33), (-1.5, 4.0)] * 3:
                assert fast.uniform(low, high) == one.uniform(low, high)
                compared += 1
            assert [fast.randint(0, 13), fast.normal(), fast.gamma(0.4), *fast.dirichlet([1.0, 2.0])] == \
                [one.randint(0, 13), one.normal(), one.gamma(0.4), *one.dirichlet([1.0, 2.0])]
    assert compared == 5 * 33 * 10
    assert SampleRandom.streams(1, 2, []) == []


def test_streams_make_one_collected_object_per_sample():
    """A batch's streams add one object the garbage collector tracks per sample, not three: allocations
    past its threshold (700) set off a collection in the process that trains, and over a batch of 256
    per op three each did so for nearly every op of every batch."""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        before = gc.get_count()[0]
        streams = SampleRandom.streams(3, 1, list(range(256)))
        added = gc.get_count()[0] - before
    finally:
        if enabled:
            gc.enable()
    assert len(streams) == 256
    assert 256 <= added <= 256 + 4  # the streams, their list and the list of uniforms they share


def test_random_resized_crop_distribution_matches_torchvision():
    spec = AugmentSpec()
    ours = [spec.draw(500, 375, seed=0, epoch=0, index=i) for i in range(4000)]
    torch.manual_seed(0)
    ref = [T.RandomResizedCrop.get_params(torch.empty(3, 375, 500), [0.08, 1.0], [3 / 4, 4 / 3])
           for _ in range(4000)]
    area_ours = np.array([b.width * b.height for b in ours]) / (500 * 375)
    area_ref = np.array([w * h for _, _, h, w in ref]) / (500 * 375)
    aspect_ours = np.log([b.width / b.height for b in ours])
    aspect_ref = np.log([w / h for _, _, h, w in ref])
    for q in (0.1, 0.5, 0.9):
        assert abs(np.quantile(area_ours, q) - np.quantile(area_ref, q)) < 0.04
        assert abs(np.quantile(aspect_ours, q) - np.quantile(aspect_ref, q)) < 0.05
    assert all(0 <= b.x and b.x + b.width <= 500 and 0 <= b.y and b.y + b.height <= 375 for b in ours)
    flips = np.mean([b.flip for b in ours])
    assert 0.46 < flips < 0.54



@pytest.mark.parametrize("ratio, scale", [((1 / 4, 4.0), (0.3, 1.0)), ((0.5, 3.0), (0.05, 0.5))])
def test_box_aspect_and_area_follow_torchvision_over_a_wide_ratio_range(ratio, scale):
    """Over a wide ratio range the log-uniform aspect (torchvision's) and a uniform one part clearly, and so do
    the areas kept once a try fits: each distribution is torchvision's (two-sample KS test)."""
    spec = AugmentSpec(scale=scale, ratio=ratio)
    ours = [spec.draw(640, 480, seed=2, epoch=1, index=i) for i in range(3000)]
    torch.manual_seed(2)
    ref = [T.RandomResizedCrop.get_params(torch.empty(3, 480, 640), list(scale), list(ratio)) for _ in range(3000)]
    assert_same_distribution([math.log(b.width / b.height) for b in ours], [math.log(w / h) for _, _, h, w in ref],
                             "log aspect")
    assert_same_distribution([b.width * b.height for b in ours], [w * h for _, _, h, w in ref], "area")
    assert_same_distribution([b.x + b.width / 2 for b in ours], [x + w / 2 for _, x, _, w in ref], "centre x")

def test_fallback_is_central_crop_for_extreme_aspect():
    # a 1000x10 strip: no random try fits the ratio range, so torchvision's central fallback applies
    box = AugmentSpec(scale=(0.9, 1.0)).draw(1000, 10, seed=0, epoch=0, index=0)
    assert (box.width, box.height) == (13, 10) and box.x == (1000 - 13) // 2 and box.y == 0


@pytest.mark.parametrize("width, height", [(1000, 10), (10, 1000), (977, 31), (31, 977), (600, 41), (41, 600)])
@pytest.mark.parametrize("ratio", [(3 / 4, 4 / 3), (0.5, 0.9), (1.3, 2.0)])
def test_the_fallback_box_is_torchvisions_for_wide_and_tall_images(width, height, ratio):
    """Where no try fits (a strip), torchvision's box is deterministic: the central crop of the ratio range's
    nearest end, for wide and tall images alike."""
    spec = AugmentSpec(scale=(0.95, 1.0), ratio=ratio)
    box = spec.draw(width, height, seed=0, epoch=0, index=0)
    y, x, h, w = T.RandomResizedCrop.get_params(torch.empty(3, height, width), [0.95, 1.0], list(ratio))
    assert (box.x, box.y, box.width, box.height) == (x, y, w, h)


def test_every_offset_is_drawn_as_torchvision_draws_it_to_both_edges():
    """A fixed crop size (one scale, one ratio) leaves a few offsets along each axis: each is drawn as often
    as torchvision draws it, the last one (the crop at the right or bottom edge) included."""
    spec = AugmentSpec(scale=(0.9, 0.9), ratio=(1.0, 1.0))
    ours = [spec.draw(70, 66, seed=1, epoch=0, index=i) for i in range(3000)]
    torch.manual_seed(1)
    ref = [T.RandomResizedCrop.get_params(torch.empty(3, 66, 70), [0.9, 0.9], [1.0, 1.0]) for _ in range(3000)]
    assert {(b.width, b.height) for b in ours} == {(w, h) for _, _, h, w in ref}
    assert_same_frequencies([b.x for b in ours], [x for _, x, _, _ in ref], "x offsets")
    assert_same_frequencies([b.y for b in ours], [y for y, _, _, _ in ref], "y offsets")
    assert {(b.width, b.height) for b in ours} == {(64, 64)}  # offsets 0-6 across, 0-2 down
    assert max(b.x + b.width for b in ours) == 70 and max(b.y + b.height for b in ours) == 66


def test_validation_geometry_is_torchvisions_resize_then_centre_crop():
    from torchvision.transforms.v2 import CenterCrop, Resize

    spec = AugmentSpec(train=False)
    for w, h in ((500, 375), (375, 500), (300, 300), (100, 61), (1999, 257)):
        g = spec.resize_crop(w, h)
        img = torch.zeros(3, h, w)
        resized = Resize(256)(img)
        assert (g.width, g.height) == (resized.shape[2], resized.shape[1])
        # CenterCrop's offsets: a marker at the crop's top-left corner lands at (0, 0)
        marked = torch.zeros(1, g.height, g.width)
        marked[0, g.top, g.left] = 1
        assert CenterCrop(224)(marked)[0, 0, 0] == 1
    assert spec.resize_crop(500, 375) == (341, 256, 58, 16)
    with pytest.raises(ValueError, match="resize_crop"):
        spec.draw(500, 375, seed=0, epoch=0, index=0)


@pytest.mark.parametrize("bad, message", [
    (dict(image_size=0), "image_size must be >= 1, got 0"),
    (dict(scale=(0.5, 0.2)), "scale must satisfy"),
    (dict(hflip=2.0), "hflip must be in"),
])
def test_spec_rejects_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        AugmentSpec(**bad)


def test_reduction_for():
    assert reduction_for(CropBox(0, 0, 300, 300), 224) == 1
    assert reduction_for(CropBox(0, 0, 900, 500), 224) == 1  # 2x would leave a near-1x resample
    assert reduction_for(CropBox(0, 0, 900, 600), 224) == 2
    assert reduction_for(CropBox(0, 0, 1800, 1800), 224) == 4
    assert reduction_for(CropBox(0, 0, 3000, 2300), 224) == 8


def test_pixel_fidelity_against_pillow_and_torchvision():
    """For fixed crop boxes: PSNR >= 28 dB against Pillow decode + torchvision antialiased resize.

    Boxes: fixed fractions and RandomResizedCrop draws, so small, large and DCT-reduced crops all occur.
    """
    dec, spec = CpuDecoder(), AugmentSpec()
    scores = []
    for i in range(24):
        data, (w, h) = synthetic_jpeg(np.random.default_rng([9, i]))
        full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        frac = (0.35, 0.7, 1.0)[i % 3]
        boxes = [CropBox((w - int(w * frac)) // 3, (h - int(h * frac)) // 2, int(w * frac), int(h * frac), i % 2 == 0),
                 spec.draw(w, h, seed=3, epoch=0, index=i)]
        for box in boxes:
            ref = F.resized_crop(torch.from_numpy(full.copy()).permute(2, 0, 1), box.y, box.x, box.height, box.width,
                                 [224, 224], antialias=True)
            if box.flip:
                ref = F.horizontal_flip(ref)
            out = np.empty((224, 224, 3), np.uint8)
            crop_resize_into(dec.decode(data, "x", fast=True, reduce=reduction_for(box, 224)), box, (w, h), out)
            scores.append(psnr(out, ref.permute(1, 2, 0).numpy()))
    assert min(scores) >= 28.0, sorted(scores)[:5]


def test_crop_resize_writes_every_pixel():
    img = np.random.default_rng(0).integers(0, 256, (100, 120, 3), dtype=np.uint8)
    out = np.full((32, 32, 3), 7, np.uint8)
    crop_resize_into(img, CropBox(10, 10, 50, 40, True), (120, 100), out)
    ref = np.full_like(out, 7)
    crop_resize_into(img, CropBox(10, 10, 50, 40, False), (120, 100), ref)
    np.testing.assert_array_equal(out, ref[:, ::-1])


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_normalize_values_layout_and_dtype(channels_last, dtype, contiguous):
    x = torch.randint(0, 256, (4, 16, 16, 3), dtype=torch.uint8)
    if not contiguous:  # the same values through an NCHW tensor's NHWC view
        x = x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)
    out = Normalize(dtype=dtype, channels_last=channels_last).images(x)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    ref = (x.permute(0, 3, 1, 2).double() / 255 - mean) / std
    assert out.shape == (4, 3, 16, 16) and out.dtype == dtype
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=fmt)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_normalize_rejects_wrong_input():
    with pytest.raises(ValueError, match="expected \\(B, H, W, 3\\) uint8"):
        Normalize().images(torch.zeros(2, 3, 8, 8))
    with pytest.raises(ValueError, match="std must be > 0"):
        Normalize(std=(1, 0, 1))


def test_cpu_batches_are_never_overwritten_while_referenced():
    """A CPU device's batch arrays are reused once nothing refers to them (no page faults per batch), and
    only then: batches kept, or views of them, keep their memory."""
    n = Normalize()
    u = torch.randint(0, 255, (4, 8, 8, 3), dtype=torch.uint8)
    kept = [n.images(u) for _ in range(3)]
    assert len({k.data_ptr() for k in kept}) == 3
    first = kept[0].clone()
    view = kept[0][:1]
    del kept
    again = [n.images(torch.zeros_like(u)) for _ in range(3)]
    assert all(a.data_ptr() != view.data_ptr() for a in again)
    assert torch.equal(view, first[:1])  # untouched by the batches made since
    seen = {a.data_ptr() for a in again}
    del again
    reused = {n.images(u).data_ptr() for _ in range(4)}
    assert reused <= seen  # each dropped at once: arrays handed out before, no new one


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_workers_normalise_as_the_main_process_would(channels_last, dtype):
    """A CPU device's workers write each image's final values into the ring (WorkerNormalize); handed out
    by ``finished``, they are exactly what ``images`` gives from the uint8 batch, in the same layout."""
    from gpufeed.augment.in_workers import WorkerNormalize

    n = Normalize(dtype=dtype, channels_last=channels_last)
    worker = n.for_workers()
    assert isinstance(worker, WorkerNormalize) and worker.layout == ("nhwc" if channels_last else "nchw")
    u = torch.randint(0, 256, (5, 16, 16, 3), dtype=torch.uint8)
    ring = np.empty((5, 16, 16, 3) if channels_last else (5, 3, 16, 16), np.float32)
    for i in range(5):
        worker.into(u[i].numpy(), ring[i])
    out = n.finished(torch.from_numpy(ring))
    expected = n.images(u)
    assert out.dtype == dtype and out.shape == (5, 3, 16, 16)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=fmt)
    assert torch.equal(out, expected)
    ring[:] = 0  # the slot reused: the batch handed out is the caller's own
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="float32 batch"):
        n.finished(u)


def test_a_torchvision_training_pipeline_is_read_for_its_parameters(synth_root):
    """``transform=`` with RandomResizedCrop(176, scale, ratio) + RandomHorizontalFlip(p) + to-tensor +
    Normalize: the loader crops with those parameters (torchvision's distribution), flips at that rate,
    normalises with that mean and std, at 176."""
    from torchvision.transforms import v2

    from gpufeed import ImageLoader

    pipeline = v2.Compose([v2.RandomResizedCrop(176, scale=(0.35, 1.0), ratio=(0.9, 1.2)),
                           v2.RandomHorizontalFlip(p=0.2), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                           v2.Normalize([0.5, 0.4, 0.3], [0.2, 0.3, 0.4])])
    loader = ImageLoader(synth_root, transform=pipeline, batch_size=8, device="cpu", num_workers=2)
    spec = loader.augment
    assert (spec.train, spec.image_size, spec.scale, spec.ratio, spec.hflip) == (True, 176, (0.35, 1.0), (0.9, 1.2), 0.2)
    assert (loader.normalize.mean, loader.normalize.std) == ((0.5, 0.4, 0.3), (0.2, 0.3, 0.4))
    images, labels = next(iter(loader))
    assert images.shape == (8, 3, 176, 176) and images.dtype == torch.float32
    loader.close()
    n = 4000
    boxes = [spec.draw(500, 375, seed=1, epoch=0, index=i) for i in range(n)]
    flips = sum(b.flip for b in boxes)
    assert abs(flips - 0.2 * n) < 4 * (n * 0.2 * 0.8) ** 0.5, flips  # binomial, 4 sigma
    areas = [b.width * b.height / (500 * 375) for b in boxes]
    aspects = [b.width / b.height for b in boxes]
    assert min(areas) >= 0.35 - 0.01 and all(0.9 - 0.02 <= a <= 1.2 + 0.02 for a in aspects)


@pytest.mark.parametrize("ops, message", [
    (lambda v2: [v2.RandomResizedCrop(224), v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.ElasticTransform()],
     "ElasticTransform stands after ToDtype; gpufeed runs the ops it has no device version of in its CPU workers"),
    (lambda v2: [v2.RandomResizedCrop(224), v2.TrivialAugmentWide(num_magnitude_bins=1)],
     r"TrivialAugmentWide\(num_magnitude_bins=1\) needs an integer >= 2"),
    (lambda v2: [v2.RandomResizedCrop(224), v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3,
                 [0.2] * 3), v2.ColorJitter(0.4)], "ColorJitter must come before ToDtype: gpufeed runs ColorJitter on uint8"),
    (lambda v2: [v2.RandomResizedCrop(224), v2.RandAugment(magnitude=31)], r"magnitude=31\) must be a bin in \[0, 31\)"),
    (lambda v2: [v2.RandomResizedCrop(8), v2.GaussianBlur(17)], "under the image size 8"),
    (lambda v2: [v2.RandomResizedCrop(224), v2.AutoAugment(interpolation=v2.InterpolationMode.BICUBIC)],
     "AutoAugment runs with nearest or bilinear"),
    (lambda v2: [v2.RandomResizedCrop(224), v2.AugMix(fill=128)], "AugMix fills with 0 here, got fill=128"),
    (lambda v2: [v2.RandomResizedCrop(224), v2.AugMix(mixture_width=0)], r"mixture_width=0\) needs an integer >= 1"),
    (lambda v2: [v2.Resize(256), v2.CenterCrop(224), v2.ColorJitter(0.4)], "ColorJitter is a training op"),
    (lambda v2: [v2.RandomResizedCrop(224), v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.RandomErasing(),
                 v2.RandomErasing()], "RandomErasing appears 2 times"),
    (lambda v2: [v2.RandomResizedCrop(224), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                 v2.RandomErasing(value="random")], "value='random'"),
    (lambda v2: [v2.RandomResizedCrop(224), v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.TrivialAugmentWide()],
     "TrivialAugmentWide must come before ToDtype"),
    (lambda v2: [v2.Resize(256), v2.CenterCrop(224), v2.TrivialAugmentWide()], "a training op"),
    (lambda v2: [v2.RandomResizedCrop(224, interpolation=v2.InterpolationMode.NEAREST)], "bilinear"),
    (lambda v2: [v2.RandomResizedCrop((224, 200))], "square output"),
    (lambda v2: [v2.RandomResizedCrop(224), v2.ToImage()], "add ToDtype"),
    (lambda v2: [v2.Resize(256), v2.CenterCrop(224), v2.ToImage(), v2.ToDtype(torch.float32)], "scale=True"),
    (lambda v2: [v2.CenterCrop(224), v2.Resize(256)], "the geometric ops must be"),
    (lambda v2: [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.RandomResizedCrop(224)],
     "RandomResizedCrop must come before ToDtype"),
])
def test_a_torchvision_pipeline_with_what_gpufeed_does_not_run_is_refused(synth_root, ops, message):
    from torchvision.transforms import v2

    from gpufeed import ImageLoader

    with pytest.raises(ValueError, match=message):
        ImageLoader(synth_root, transform=v2.Compose(ops(v2)), device="cpu", num_workers=1)


def test_a_transform_and_the_settings_it_replaces_are_not_taken_together(synth_root):
    from torchvision.transforms import v2

    from gpufeed import ImageLoader

    pipeline = v2.Compose([v2.RandomResizedCrop(64), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    with pytest.raises(ValueError, match=r"leave out image_size=32 \(the transform's: 64\), mean=\(0.5, 0.5, 0.5\)"):
        ImageLoader(synth_root, transform=pipeline, image_size=32, mean=(0.5, 0.5, 0.5), device="cpu")
    same = ImageLoader(synth_root, transform=pipeline, train=True, image_size=64, device="cpu", num_workers=1,
                       batch_size=8)
    assert same.augment.image_size == 64  # the same values beside it are fine
    same.close()
    with pytest.raises(ValueError, match="dtype=torch.bfloat16 but the transform casts to torch.float32"):
        ImageLoader(synth_root, transform=pipeline, dtype=torch.bfloat16, device="cpu")
    bf16 = v2.Compose([v2.RandomResizedCrop(64), v2.ToImage(), v2.ToDtype(torch.bfloat16, scale=True)])
    with pytest.raises(ValueError, match="dtype=torch.float32 but the transform casts to torch.bfloat16"):
        ImageLoader(synth_root, transform=bf16, dtype=torch.float32, device="cpu")  # an explicit float32 too


def test_pixel_ops_are_read_in_order_from_either_torchvision_api():
    """The same pipeline written with torchvision.transforms and torchvision.transforms.v2 reads to the same
    ops with the same parameters, in the order written; ops that give the same pixels either side of a flip
    may stand before RandomHorizontalFlip."""
    from torchvision import transforms as v1
    from torchvision.transforms import v2

    from gpufeed.augment.ops import AugMix, AutoAugment, Blur, Grayscale, Jitter, RandAugment, Sharpen, VerticalFlip
    from gpufeed.augment.recipe import read_transform

    def pipeline(api):
        return api.Compose([api.RandomResizedCrop(64), api.ColorJitter(0.4, (0.5, 1.5), 0.2, 0.1),
                            api.RandomGrayscale(0.3), api.RandomHorizontalFlip(0.25), api.RandomVerticalFlip(0.1),
                            api.GaussianBlur((5, 3), (0.2, 1.5)), api.RandomAdjustSharpness(2.0, 0.4),
                            api.RandAugment(3, 5, 11, interpolation=api.InterpolationMode.BILINEAR), api.AutoAugment(),
                            api.AugMix(severity=2, chain_depth=1), api.PILToTensor(),
                            api.ConvertImageDtype(torch.float32)])

    new, old = read_transform(pipeline(v2)), read_transform(pipeline(v1))
    assert new == old and new.hflip == 0.25
    jitter = new.pixel[0]
    assert jitter == Jitter((0.6, 1.4), (0.5, 1.5), jitter.saturation, (-0.1, 0.1))
    assert abs(jitter.saturation[0] - 0.8) < 1e-12 and abs(jitter.saturation[1] - 1.2) < 1e-12
    assert new.pixel[1:-2] == (Grayscale(0.3), VerticalFlip(0.1), Blur((5, 3), (0.2, 1.5)), Sharpen(2.0, 0.4),
                               RandAugment(3, 5, 11, "bilinear"))
    assert isinstance(new.pixel[-2], AutoAugment) and len(new.pixel[-2].policies) == 25
    assert new.pixel[-1] == AugMix(severity=2, chain_depth=1)


@pytest.mark.parametrize("image_size", [96, 160, 176, 224])
def test_validation_resizes_by_default_to_the_documented_256_224_ratio_rounded(image_size):
    """docs/options.md: ``resize_size`` defaults to ``round(image_size * 256 / 224)`` (96 -> 110, 160 -> 183:
    sizes where truncating would give one less), and the geometry is torchvision's for that size."""
    from torchvision.transforms.v2 import CenterCrop, Resize

    from gpufeed.pipeline import read_settings

    resize = round(image_size * 256 / 224)
    settings = read_settings(None, train=False, image_size=image_size, resize_size=None, mean=None, std=None,
                             dtype=None, channels_last=False)  # what ImageLoader(train=False, image_size=...) takes
    assert settings.augment.resize_size == resize
    g = settings.augment.resize_crop(400, 300)
    resized = Resize(resize)(torch.zeros(1, 300, 400))
    assert (g.width, g.height) == (resized.shape[2], resized.shape[1])
    marked = torch.zeros(1, g.height, g.width)
    marked[0, g.top, g.left] = 1
    assert CenterCrop(image_size)(marked)[0, 0, 0] == 1


@pytest.mark.parametrize("api", ["v1", "v2"])
def test_a_crop_without_a_flip_op_is_never_flipped(api):
    """RandomResizedCrop and RandomCrop with no RandomHorizontalFlip after them: no sample is flipped, as
    torchvision flips none."""
    import torchvision.transforms as v1
    from torchvision.transforms import v2

    from gpufeed.augment.recipe import read_transform

    t = v1 if api == "v1" else v2
    tensor = [t.ToTensor()] if api == "v1" else [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    for crop in (t.RandomResizedCrop(32, scale=(0.5, 1.0)), t.RandomCrop(32, padding=2)):
        spec = AugmentSpec(**read_transform(t.Compose([crop, *tensor])).augment_kwargs())
        assert spec.hflip == 0.0
        if spec.box_crop:
            draws = [spec.draw(60, 50, seed=1, epoch=0, index=i).flip for i in range(300)]
        else:
            draws = [spec.random_crop(60, 50, seed=1, epoch=0, index=i).flip for i in range(300)]
        assert not any(draws)
