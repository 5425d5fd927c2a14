"""Per-sample TrivialAugmentWide and RandomErasing (augment.ops): torchvision's distributions, torchvision's
pixels for each fixed choice, and the loader applying them to the samples it delivers."""

import collections
import math

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from gpufeed import ImageLoader
from gpufeed.augment.ops import NUM_BINS, TRIVIAL_WIDE, Erasing, SampleOps, apply_trivial, trivial_choice


def test_trivial_choices_follow_torchvisions_distribution():
    n = 28_000
    draws = [trivial_choice(3, 1, i) for i in range(n)]
    ops = collections.Counter(name for name, _ in draws)
    assert set(ops) == set(TRIVIAL_WIDE)
    expected = n / len(TRIVIAL_WIDE)
    chi2 = sum((c - expected) ** 2 / expected for c in ops.values())
    assert chi2 < 36.1, ops  # 13 degrees of freedom, p = 0.001
    rotations = [m for name, m in draws if name == "Rotate"]
    magnitudes = TRIVIAL_WIDE["Rotate"][0]
    bins = collections.Counter(magnitudes.index(abs(m)) for m in rotations)
    expected = len(rotations) / NUM_BINS
    assert sum((bins[b] - expected) ** 2 / expected for b in range(NUM_BINS)) < 59.7  # 30 dof, p = 0.001
    negative = sum(m < 0 for m in rotations if m != 0)
    nonzero = sum(m != 0 for m in rotations)
    assert abs(negative - nonzero / 2) < 4 * math.sqrt(nonzero / 4)
    assert trivial_choice(3, 1, 5) == trivial_choice(3, 1, 5) and trivial_choice(3, 2, 5) != trivial_choice(3, 1, 5)


@pytest.mark.parametrize("name", list(TRIVIAL_WIDE))
def test_each_trivial_operation_gives_torchvisions_pixels(name):
    apply = getattr(v2.TrivialAugmentWide(), "_apply_image_or_video_transform", None)
    if apply is None:
        pytest.skip("this torchvision keeps TrivialAugmentWide's operations elsewhere")
    images = torch.randint(0, 256, (3, 3, 40, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    magnitudes, signed = TRIVIAL_WIDE[name]
    compared = 0
    for m in ([0.0] if magnitudes is None else [magnitudes[0], magnitudes[17], magnitudes[-1]]):
        for sign in ((1, -1) if signed else (1,)):
            ours = apply_trivial(images, name, sign * float(m))
            theirs = apply(images, name, sign * float(m), interpolation=v2.InterpolationMode.NEAREST, fill={})
            assert torch.equal(ours, theirs), (name, m, sign)
            compared += 1
    assert compared >= 1


def test_erasing_boxes_follow_torchvisions_distribution():
    erasing, size, n = Erasing(p=0.5), 64, 6000
    ours = [erasing.box(size, 1, 0, i) for i in range(n)]
    applied = [b for b in ours if b is not None]
    assert abs(len(applied) - n / 2) < 4 * math.sqrt(n / 4)
    t = v2.RandomErasing(p=1.0)
    torch.manual_seed(0)
    theirs = [t.make_params([torch.zeros(3, size, size)]) for _ in range(len(applied))]
    theirs = [(p["i"], p["j"], p["h"], p["w"]) for p in theirs if p["v"] is not None]
    for k, what in ((2, "height"), (3, "width")):
        a = np.array([b[k] for b in applied], float)
        b = np.array([b[k] for b in theirs], float)
        assert abs(a.mean() - b.mean()) < 4 * math.sqrt(a.var() / len(a) + b.var() / len(b)), what
    assert all(0 <= t_ <= size - h and 0 <= l_ <= size - w for t_, l_, h, w in applied)


def test_the_loader_applies_each_samples_ops_to_that_sample(synth_root):
    """TrivialAugmentWide and RandomErasing in ``transform``: each delivered sample has the ops its own
    draws give (checked by applying them to the same batch from a loader without them), and two loaders with
    the same seed deliver the same bits."""
    head = [v2.RandomResizedCrop(32), v2.RandomHorizontalFlip()]
    tail = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)]
    kw = dict(batch_size=8, device="cpu", num_workers=2, seed=9)
    with_ops = v2.Compose(head + [v2.TrivialAugmentWide()] + tail + [v2.RandomErasing(p=1.0, value=0)])
    a = ImageLoader(synth_root, transform=with_ops, **kw)
    b = ImageLoader(synth_root, transform=with_ops, **kw)
    plain = ImageLoader(synth_root, transform=v2.Compose(head + tail), **kw)
    ops = SampleOps(trivial=True, erasing=Erasing(p=1.0), mean=[0.5] * 3, std=[0.25] * 3)
    compared = 0
    for (xa, ya), (xb, yb), (xp, yp) in zip(a, b, plain, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yp) and a.batch_indices == plain.batch_indices
        given = xp.clone()
        assert torch.equal(xa, ops(given, plain.batch_indices, 9, 0)) and torch.equal(given, xp)  # a new batch
        assert not torch.equal(xa, xp)
        compared += 1
    assert compared == len(a) == 5
    for loader in (a, b, plain):
        loader.close()


def test_one_pass_per_operation_gives_what_torchvision_gives_each_sample():
    """All the samples that drew an operation go through it together with their own magnitudes: against
    torchvision's op on each sample alone, the same pixels (geometry, brightness, solarize, posterize, auto
    contrast, equalize), and at most one level apart for the blends (colour, contrast, sharpness: a sum
    in another order), and those rarely."""
    from gpufeed.augment.ops import apply_trivial_batch

    g = torch.Generator().manual_seed(4)
    images = torch.randint(0, 256, (280, 3, 24, 24), dtype=torch.uint8, generator=g)
    choices = [trivial_choice(7, 0, i) for i in range(len(images))]
    batched = apply_trivial_batch(images, choices)
    per_op = collections.defaultdict(list)
    for i, (name, m) in enumerate(choices):
        alone = apply_trivial(images[i : i + 1], name, m)[0]
        diff = (batched[i].int() - alone.int()).abs()
        per_op[name].append((int(diff.max()), float(diff.float().mean())))
    assert set(per_op) == set(TRIVIAL_WIDE) and sum(len(v) for v in per_op.values()) == 280
    for name, diffs in per_op.items():
        worst, mean = max(d for d, _ in diffs), np.mean([m for _, m in diffs])
        if name in ("Color", "Contrast", "Sharpness"):
            assert worst <= 1 and mean <= 1 / 255, (name, worst, mean)  # levels: within a level, rarely off
        else:
            assert worst == 0, (name, worst)


def test_per_sample_ops_follow_the_epoch_and_keep_the_layout_and_dtype(synth_root):
    """In epoch 1, channels_last and bfloat16: each sample's ops are its epoch-1 draws, and the batch keeps
    its memory format and dtype."""
    head = [v2.RandomResizedCrop(32)]
    tail = [v2.ToImage(), v2.ToDtype(torch.bfloat16, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)]
    kw = dict(batch_size=8, device="cpu", num_workers=2, seed=4, channels_last=True)
    a = ImageLoader(synth_root, transform=v2.Compose(head + [v2.TrivialAugmentWide()] + tail
                                                      + [v2.RandomErasing(p=0.5, value=1.5)]), **kw)
    plain = ImageLoader(synth_root, transform=v2.Compose(head + tail), **kw)
    a.set_epoch(1), plain.set_epoch(1)
    ops = SampleOps(trivial=True, erasing=Erasing(p=0.5, value=(1.5,)), mean=[0.5] * 3, std=[0.25] * 3)
    compared = 0
    for (xa, _), (xp, _) in zip(a, plain, strict=True):
        assert xa.dtype == torch.bfloat16 and xa.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(xa, ops(xp, plain.batch_indices, 4, 1))
        assert not torch.equal(xa, ops(xp, plain.batch_indices, 4, 0))  # other draws in another epoch
        compared += 1
    assert compared == 5
    a.close(), plain.close()


def test_each_erased_box_is_exactly_where_its_draw_puts_it():
    erasing = Erasing(p=0.7, value=(2.0, 3.0, 4.0))
    ops = SampleOps(trivial=False, erasing=erasing, mean=[0.0] * 3, std=[1.0] * 3)
    out = ops(torch.zeros(40, 3, 20, 20), list(range(100, 140)), 6, 2)
    erased = 0
    for i in range(40):
        want = torch.zeros(3, 20, 20)
        box = erasing.box(20, 6, 2, 100 + i)
        if box is not None:
            top, left, h, w = box
            want[:, top : top + h, left : left + w] = torch.tensor([2.0, 3.0, 4.0]).view(3, 1, 1)
            erased += 1
        assert torch.equal(out[i], want), i
    assert 15 <= erased <= 40
