"""TrivialAugmentWide, RandAugment, AutoAugment and RandomErasing per sample (augment.ops): their draws against
torchvision's own, torchvision's pixels for torchvision's draws, and the loader applying them."""

import math

import pytest
import torch
from torchvision.transforms import v2

from gpufeed import ImageLoader
from gpufeed.augment.ops import (AugMix, AugMixChoice, AutoAugment, Erasing, RandAugment, SampleOps, TrivialAugment,
                                 apply_operation, apply_operations)
from gpufeed.augment.ops.auto import OPERATIONS, STANDARD, WIDE
from gpufeed.augment.fused import normalize_constants
from gpufeed.augment.recipe import read_transform

from .stats import assert_same_distribution, assert_same_frequencies

SIZE = 32
AUTO = [v2.TrivialAugmentWide(), v2.TrivialAugmentWide(num_magnitude_bins=8),
        v2.RandAugment(), v2.RandAugment(num_ops=3, magnitude=4, num_magnitude_bins=10),
        v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET), v2.AutoAugment(v2.AutoAugmentPolicy.SVHN)]
AUTO_IDS = ["trivial", "trivial-8-bins", "randaugment", "randaugment-3-ops", "autoaugment", "autoaugment-svhn"]


def _ours(t):
    return read_transform(v2.Compose([v2.RandomResizedCrop(SIZE), t])).pixel[0]


def _torchvision_steps(t, images, apply=False):
    """torchvision's own draws for each image (the (operation, magnitude) pairs it applies, recorded where
    its transforms hand them to ``_apply_image_or_video_transform``) and, with ``apply``, its output."""
    original = type(t)._apply_image_or_video_transform
    steps, outs = [], []

    def record(image, transform_id, magnitude, interpolation, fill):
        steps[-1].append((transform_id, magnitude))
        return original(t, image, transform_id, magnitude, interpolation, fill) if apply else image

    t._apply_image_or_video_transform = record
    try:
        for img in images:
            steps.append([])
            outs.append(t(img))
    finally:
        del t._apply_image_or_video_transform
    return [tuple(s) for s in steps], outs


@pytest.mark.parametrize("t", AUTO, ids=AUTO_IDS)
def test_auto_augment_draws_follow_torchvisions(t):
    """The operations, magnitudes and signs each sample gets, against torchvision's transform run on 16,000
    images: each whole choice, each step's operation and each step's magnitude within binomial bounds."""
    n = 16_000
    op = _ours(t)
    auto = isinstance(t, v2.AutoAugment)
    ours = SampleOps.draws(op, range(n), seed=3, epoch=1, size=SIZE)
    torch.manual_seed(0)
    theirs, _ = _torchvision_steps(t, [torch.zeros(3, SIZE, SIZE, dtype=torch.uint8)] * n)
    if auto:  # torchvision hands on only the operations a sub-policy runs
        ours = [tuple(s for s in steps if s[0] != "Identity") for steps in ours]
    pairs = lambda draws: {step for steps in draws for step in steps}  # noqa: E731
    assert len(pairs(theirs)) > 20 and pairs(ours) == pairs(theirs)
    compared = assert_same_frequencies(ours, theirs, "choice")
    for k in range(max(len(s) for s in theirs)):
        at = lambda draws: [s[k][0] if len(s) > k else None for s in draws]  # noqa: E731
        compared += assert_same_frequencies(at(ours), at(theirs), f"operation {k}")
        at = lambda draws: [s[k][1] for s in draws if len(s) > k]  # noqa: E731
        compared += assert_same_frequencies(at(ours), at(theirs), f"magnitude {k}")
    assert compared >= 3 * n


def test_trivial_draws_depend_on_the_sample_and_epoch_only():
    op = TrivialAugment()
    a = SampleOps.draws(op, range(200), seed=3, epoch=1, size=SIZE)
    assert a == SampleOps.draws(op, range(200), seed=3, epoch=1, size=SIZE)
    assert a[5:9] == SampleOps.draws(op, range(5, 9), seed=3, epoch=1, size=SIZE)
    assert a != SampleOps.draws(op, range(200), seed=3, epoch=2, size=SIZE)


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
@pytest.mark.parametrize("name", OPERATIONS)
def test_each_operation_is_torchvisions(name, interpolation):
    """apply_operation (the reference the batched pass falls back on) against torchvision's own
    ``_apply_image_or_video_transform`` at the ends and middle of each space, both signs."""
    images = torch.randint(0, 256, (3, 3, 40, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    theirs = v2.RandAugment()._apply_image_or_video_transform
    compared = 0
    for space in (WIDE, STANDARD):
        if name not in space:
            continue
        fn, signed = space[name]
        for m in [0.0] if fn is None else [float(x) for x in fn(31, 40)[[0, 17, -1]]]:
            for sign in (1, -1) if signed else (1,):
                mode = v2.InterpolationMode(interpolation)
                assert torch.equal(apply_operation(images, name, sign * m, interpolation),
                                   theirs(images, name, sign * m, interpolation=mode, fill={})), (name, m, sign)
                compared += 1
    assert compared >= 1


def test_autocontrast_and_equalize_give_torchvisions_pixels_for_every_kind_of_channel():
    """The batched passes against torchvision's functional ops image by image, exactly, on channels of one
    value, of two, of a narrow range, with all but a few pixels at the brightest (equalize's step of 0: left
    as they are), of the full range, and a mix of these within one image."""
    from torchvision.transforms.v2 import functional as F

    from gpufeed.augment.ops import pixels

    g = torch.Generator().manual_seed(4)
    rand = lambda low, high: torch.randint(low, high, (24, 24), dtype=torch.uint8, generator=g)  # noqa: E731
    kinds = [lambda: torch.full((24, 24), 77, dtype=torch.uint8), lambda: rand(0, 2) * 200 + 30,
             lambda: rand(100, 111), lambda: rand(0, 256),
             lambda: torch.full((24, 24), 200, dtype=torch.uint8).index_fill_(0, torch.tensor([3]), 9),
             lambda: torch.full((24, 24), 255, dtype=torch.uint8).index_fill_(1, torch.tensor([0, 5]), 0)]
    images = torch.stack([torch.stack([kinds[(i + c * (i // 6)) % len(kinds)]() for c in range(3)])
                          for i in range(24)])
    compared = 0
    for ours, theirs in ((pixels.autocontrast, F.autocontrast), (pixels.equalize, F.equalize)):
        out = ours(images)
        assert out.dtype == torch.uint8 and not torch.equal(out, images)  # something to compare
        for i in range(len(images)):
            assert torch.equal(out[i], theirs(images[i])), (theirs.__name__, i)
            compared += 1
    assert compared == 48


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
@pytest.mark.parametrize("t", AUTO, ids=AUTO_IDS)
def test_a_batch_gets_torchvisions_pixels_for_torchvisions_draws(t, interpolation):
    """96 images, each through torchvision's transform with its own draws; the same draws given to the
    batched ops (one pass per operation per step): the same pixels but for rare one-level steps in the
    blends, carried on by a later step."""
    t = type(t)(**{**{k: getattr(t, k) for k in ("num_ops", "magnitude", "num_magnitude_bins", "policy")
                      if hasattr(t, k)}, "interpolation": v2.InterpolationMode(interpolation)})
    images = torch.randint(0, 256, (96, 3, SIZE, SIZE), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1)
    steps, theirs = _torchvision_steps(t, images, apply=True)
    width = max(len(s) for s in steps)
    ours = images
    for k in range(width):
        ours = apply_operations(ours, [s[k] if len(s) > k else ("Identity", 0.0) for s in steps], interpolation)
    diff = (ours.int() - torch.stack(theirs).int()).abs()
    assert len({name for s in steps for name, _ in s}) >= 8
    assert float(diff.float().mean()) <= 1 / 255 and float((diff > 1).float().mean()) < 1e-3, int(diff.max())


def test_erasing_boxes_follow_torchvisions_distribution():
    erasing, size, n = Erasing(p=0.5), 64, 6000
    ours = SampleOps.draws(erasing, range(n), 1, 0, size)
    theirs = v2.RandomErasing(p=0.5)
    torch.manual_seed(0)
    img = torch.zeros(3, size, size)
    theirs = [theirs.make_params([img]) if torch.rand(1) < 0.5 else None for _ in range(n)]
    theirs = [None if p is None or p["v"] is None else (p["i"], p["j"], p["h"], p["w"]) for p in theirs]
    compared = assert_same_frequencies([b is None for b in ours], [b is None for b in theirs], "erased")
    for k, what in enumerate(("top", "left", "height", "width")):
        compared += assert_same_distribution([b[k] for b in ours if b], [b[k] for b in theirs if b], what)
    assert compared == n + 4 * sum(b is not None for b in ours)
    assert all(0 <= t_ <= size - h and 0 <= l_ <= size - w for t_, l_, h, w in filter(None, ours))


def test_each_erased_box_is_exactly_where_its_draw_puts_it():
    erasing = Erasing(p=0.7, value=(2.0, 3.0, 4.0))
    ops = SampleOps(erasing=erasing, mean=[0.0] * 3, std=[1.0] * 3)
    out = ops(torch.zeros(40, 3, 20, 20), list(range(100, 140)), 6, 2)
    boxes = SampleOps.draws(erasing, range(100, 140), 6, 2, 20)
    erased = 0
    for i, box in enumerate(boxes):
        want = torch.zeros(3, 20, 20)
        if box is not None:
            top, left, h, w = box
            want[:, top : top + h, left : left + w] = torch.tensor([2.0, 3.0, 4.0]).view(3, 1, 1)
            erased += 1
        assert torch.equal(out[i], want), i
    assert 15 <= erased <= 40


HEAD = [v2.RandomResizedCrop(32), v2.RandomHorizontalFlip()]
TAIL = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)]
PIXEL = [v2.RandomVerticalFlip(0.3), v2.ColorJitter(0.4, 0.4, 0.4, 0.1), v2.RandomGrayscale(0.2),
         v2.GaussianBlur(5, (0.1, 2.0)), v2.RandomAdjustSharpness(2.0, 0.5), v2.TrivialAugmentWide(),
         v2.RandAugment(), v2.AutoAugment()]


def test_the_loader_applies_each_samples_ops_to_that_sample(synth_root):
    """Every pixel op and RandomErasing in ``transform``: each delivered sample has the ops its own draws
    give, in the order written (checked by applying them to the same batch from a loader without them), and
    two loaders with the same seed deliver the same bits."""
    kw = dict(batch_size=8, device="cpu", num_workers=2, seed=9)
    with_ops = v2.Compose(HEAD + PIXEL + TAIL + [v2.RandomErasing(p=1.0, value=0)])
    a = ImageLoader(synth_root, transform=with_ops, **kw)
    b = ImageLoader(synth_root, transform=with_ops, **kw)
    plain = ImageLoader(synth_root, transform=v2.Compose(HEAD + TAIL), **kw)
    recipe = read_transform(with_ops)
    assert [type(op).__name__ for op in recipe.pixel] == ["VerticalFlip", "Jitter", "Grayscale", "Blur", "Sharpen",
                                                          "TrivialAugment", "RandAugment", "AutoAugment"]
    ops = SampleOps(pixel=recipe.pixel, erasing=Erasing(p=1.0), mean=[0.5] * 3, std=[0.25] * 3)
    compared = 0
    for (xa, ya), (xb, yb), (xp, yp) in zip(a, b, plain, strict=True):
        assert xa.shape == (8, 3, 32, 32) and xa.dtype == torch.float32
        assert torch.equal(xa, xb) and torch.equal(ya, yp) and a.batch_indices == plain.batch_indices
        given = xp.clone()
        assert torch.equal(xa, ops(given, plain.batch_indices, 9, 0)) and torch.equal(given, xp)  # a new batch
        assert not torch.equal(xa, xp)
        compared += 1
    assert compared == len(a) == 5
    for loader in (a, b, plain):
        loader.close()


def test_per_sample_ops_follow_the_epoch_and_keep_the_layout_and_dtype(synth_root):
    """In epoch 1, channels_last and bfloat16: each sample's ops are its epoch-1 draws, and the batch keeps
    its memory format and dtype."""
    head = [v2.RandomResizedCrop(32)]
    tail = [v2.ToImage(), v2.ToDtype(torch.bfloat16, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)]
    kw = dict(batch_size=8, device="cpu", num_workers=2, seed=4, channels_last=True)
    a = ImageLoader(synth_root, transform=v2.Compose(head + [v2.ColorJitter(0.5, hue=0.2), v2.TrivialAugmentWide()]
                                                      + tail + [v2.RandomErasing(p=0.5, value=1.5)]), **kw)
    plain = ImageLoader(synth_root, transform=v2.Compose(head + tail), **kw)
    a.set_epoch(1), plain.set_epoch(1)
    ops = SampleOps(pixel=a.sample_ops.pixel, erasing=Erasing(p=0.5, value=(1.5,)), mean=[0.5] * 3, std=[0.25] * 3)
    compared = 0
    for (xa, _), (xp, _) in zip(a, plain, strict=True):
        assert xa.dtype == torch.bfloat16 and xa.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(xa, ops(xp, plain.batch_indices, 4, 1))
        assert not torch.equal(xa, ops(xp, plain.batch_indices, 4, 0))  # other draws in another epoch
        compared += 1
    assert compared == 5
    a.close(), plain.close()


def test_the_pixel_ops_share_one_round_trip_to_uint8():
    """Two pixel ops in a row give what the second gives on the first's uint8 output: the batch is not
    rounded back to floats between them."""
    recipe = read_transform(v2.Compose(HEAD + [v2.ColorJitter(0.8, 0.8), v2.RandomAdjustSharpness(3.0, p=1.0)] + TAIL))
    jitter, sharpen = recipe.pixel
    mean, std = torch.tensor([0.5] * 3).view(1, 3, 1, 1), torch.tensor([0.25] * 3).view(1, 3, 1, 1)
    pixels = torch.randint(0, 256, (12, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    out = SampleOps(pixel=recipe.pixel, mean=[0.5] * 3, std=[0.25] * 3)((pixels / 255 - mean) / std, range(12), 2, 0)
    want = sharpen.apply(jitter.apply(pixels, SampleOps.draws(jitter, range(12), 2, 0, 16)), [True] * 12)
    scale, shift = (torch.tensor(v).view(1, 3, 1, 1) for v in normalize_constants([0.5] * 3, [0.25] * 3))
    assert torch.equal(out, want * scale + shift) and math.isfinite(float(out.sum()))  # as Normalize computes it


def _torchvision_augmix(t, images, apply=False):
    """torchvision's AugMix draws for each image (its two Dirichlet draws, recorded where it samples them, and
    the (operation, magnitude) pairs of its chains, one after the other) and, with ``apply``, its output."""
    sample, original = t._sample_dirichlet, type(t)._apply_image_or_video_transform
    draws = []

    def dirichlet(params):
        out = sample(params)
        draws[-1][0].append(out[0].tolist())
        return out

    def record(image, transform_id, magnitude, interpolation, fill):
        draws[-1][1].append((transform_id, magnitude))
        return original(t, image, transform_id, magnitude, interpolation, fill) if apply else image

    t._sample_dirichlet, t._apply_image_or_video_transform = dirichlet, record
    outs = []
    try:
        for img in images:
            draws.append(([], []))
            outs.append(t(img))
    finally:
        del t._sample_dirichlet, t._apply_image_or_video_transform
    return draws, outs


@pytest.mark.parametrize("t", [v2.AugMix(), v2.AugMix(severity=6, mixture_width=2, alpha=0.5, all_ops=False)],
                         ids=["default", "partial"])
def test_augmix_draws_follow_torchvisions(t):
    """The original's weight, the first chain's weight, how many operations a sample gets in all, and each
    operation with its magnitude, against torchvision's AugMix run on 6000 images."""
    n = 6000
    ours = SampleOps.draws(_ours(t), range(n), seed=3, epoch=1, size=SIZE)
    torch.manual_seed(0)
    theirs, _ = _torchvision_augmix(t, [torch.zeros(3, SIZE, SIZE, dtype=torch.uint8)] * n)
    compared = assert_same_distribution([c.weights[0] for c in ours], [m[0] for (m, _), _ in theirs], "original")
    compared += assert_same_distribution([c.weights[1] for c in ours], [w[0] * m[1] for (m, w), _ in theirs], "chain")
    steps = lambda c: [s for chain in c.chains for s in chain if s[0] != "Identity"]  # noqa: E731
    compared += assert_same_frequencies([len(steps(c)) for c in ours], [len(s) for _, s in theirs], "operations")
    compared += assert_same_frequencies([s for c in ours for s in steps(c)], [s for _, ss in theirs for s in ss], "steps")
    assert compared > 4 * n and all(abs(sum(c.weights) - 1) < 1e-9 for c in ours)


def test_augmix_gives_torchvisions_pixels_for_torchvisions_draws():
    """48 images through torchvision's AugMix (chains of two, bilinear), each with its own draws; the same
    draws mixed in one batched pass."""
    t = v2.AugMix(chain_depth=2)
    images = torch.randint(0, 256, (48, 3, SIZE, SIZE), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(2)
    draws, theirs = _torchvision_augmix(t, images, apply=True)
    choices = [AugMixChoice((m[0], *(torch.tensor(w) * m[1]).tolist()), (tuple(s[0:2]), tuple(s[2:4]), tuple(s[4:6])))
               for (m, w), s in draws]
    ours = _ours(t).apply(images, choices)
    diff = (ours.int() - torch.stack(theirs).int()).abs()
    assert len(choices) == 48 and len({name for _, s in draws for name, _ in s}) >= 10
    assert float(diff.float().mean()) <= 1 / 255 and float((diff > 1).float().mean()) < 1e-3, int(diff.max())


@pytest.mark.parametrize("make, message", [
    (lambda: RandAugment(magnitude=12, num_bins=10), r"RandAugment\(magnitude=12\) must be a bin in \[0, 10\)"),
    (lambda: RandAugment(num_ops=-1), r"num_ops=-1\) needs an integer >= 0"),
    (lambda: TrivialAugment(interpolation="bicubic"), "TrivialAugmentWide runs with nearest or bilinear.*'bicubic'"),
    (lambda: AutoAugment(policies=((("Warp", 0.5, 3),),)), r"uses \['Warp'\], which are not AutoAugment operations"),
    (lambda: AutoAugment(policies=((("Rotate", 0.5, None),),)), r"steps \[\('Rotate', 0.5, None\)\]"),
    (lambda: AugMix(severity=11), r"AugMix\(severity=11\) needs an integer in \[1, 10\]"),
    (lambda: AugMix(alpha=0.0), r"AugMix\(alpha=0.0\) needs a number > 0"),
])
def test_an_auto_augment_op_gpufeed_cannot_run_is_refused_naming_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("dtype, channels_last", [(torch.float32, False), (torch.bfloat16, True)])
def test_pixel_ops_on_a_cpu_device_start_from_the_workers_uint8(synth_root, monkeypatch, dtype, channels_last):
    """Where a CPU device's workers normalise (here from 2 workers), a recipe with pixel ops has them hand over
    uint8 crops instead, and the ops start from those (``from_pixels``, every batch): the same bits as
    normalising first and going back; and a sample no op changed is the plain loader's."""
    from gpufeed import placement

    monkeypatch.setattr(placement, "WORKERS_NORMALISE_FROM", 2)
    kw = dict(batch_size=8, device="cpu", num_workers=2, seed=3, channels_last=channels_last)
    tail = [v2.ToImage(), v2.ToDtype(dtype, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)]
    with_ops = ImageLoader(synth_root, transform=v2.Compose(HEAD + [v2.TrivialAugmentWide(), v2.ColorJitter(0.4)] + tail
                                                            + [v2.RandomErasing(p=0.5)]), **kw)
    no_op = ImageLoader(synth_root, transform=v2.Compose(HEAD + [v2.RandAugment(num_ops=0)] + tail), **kw)
    plain = ImageLoader(synth_root, transform=v2.Compose(HEAD + tail), **kw)
    assert with_ops.spec.normalize is None and no_op.spec.normalize is None  # uint8 from the workers
    assert plain.spec.normalize is not None  # normalised there
    calls = []
    for loader in (with_ops, no_op):
        ops = loader.sample_ops
        ops.from_pixels = lambda *a, _f=ops.from_pixels, **k: calls.append(1) or _f(*a, **k)
    compared = 0
    for (xa, _), (xn, _), (xp, _) in zip(with_ops, no_op, plain, strict=True):
        assert xa.dtype == dtype and xa.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert torch.equal(xa, with_ops.sample_ops(xp, plain.batch_indices, 3, 0)) and not torch.equal(xa, xp)
        assert torch.equal(xn, xp)
        compared += 1
    assert compared == 5 and len(calls) == 10
    for loader in (with_ops, no_op, plain):
        loader.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_imagenet_normalisation_taken_back_gives_every_level(dtype):
    """The round trip ``SampleOps.__call__`` makes (and ``from_pixels`` skips) gives every uint8 level of each
    channel back with ImageNet's constants: the two paths give the same bits."""
    from gpufeed.augment.normalize import IMAGENET_MEAN, IMAGENET_STD, Normalize

    levels = torch.arange(256, dtype=torch.uint8).view(1, 16, 16, 1).expand(1, 16, 16, 3).contiguous()
    normalised = Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype=dtype).images(levels)
    recipe = read_transform(v2.Compose([v2.RandomResizedCrop(16), v2.RandAugment(num_ops=0), v2.ToImage(),
                                        v2.ToDtype(dtype, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]))
    ops = SampleOps(pixel=recipe.pixel, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    taken_back = ops(normalised, [0], 0, 0)
    from_pixels = ops.from_pixels(levels.permute(0, 3, 1, 2), [0], 0, 0, dtype=dtype, channels_last=False)
    assert taken_back.dtype == dtype and torch.equal(taken_back, from_pixels) and torch.equal(from_pixels, normalised)
