"""ColorJitter, RandomGrayscale, GaussianBlur, RandomAdjustSharpness and RandomVerticalFlip per sample
(augment.ops.basic): their draws against torchvision's own over thousands of samples, and their pixels for
torchvision's draws against torchvision's transform on each image."""

import itertools

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from gpufeed.augment.ops import Blur, Grayscale, Jitter, JitterChoice, SampleOps, Sharpen, VerticalFlip
from gpufeed.augment.recipe import read_transform

from .stats import assert_same_distribution, assert_same_frequencies

N = 4000


def _ours(tv_op, n=N, size=32):
    """gpufeed's op as read from the torchvision transform, and its draws for n samples."""
    op = read_transform(v2.Compose([v2.RandomResizedCrop(size), tv_op])).pixel[0]
    return op, SampleOps.draws(op, range(n), seed=5, epoch=1, size=size)


def _make_params(t):
    return (getattr(t, "make_params", None) or t._get_params)([])  # torchvision >= 0.21 / earlier


def test_jitter_draws_follow_torchvisions():
    """The order of the four functions (24 orders) and each factor, against ColorJitter.make_params."""
    t = v2.ColorJitter(brightness=0.4, contrast=(0.2, 1.9), saturation=0.7, hue=0.3)
    op, ours = _ours(t)
    assert op == Jitter(t.brightness, t.contrast, t.saturation, t.hue) and t.contrast == (0.2, 1.9)
    torch.manual_seed(0)
    theirs = [_make_params(t) for _ in range(N)]
    orders = [tuple(p["fn_idx"].tolist()) for p in theirs]
    assert set(orders) == set(itertools.permutations(range(4)))
    compared = assert_same_frequencies([c.order for c in ours], orders, "ColorJitter order")
    for i, key in enumerate(("brightness_factor", "contrast_factor", "saturation_factor", "hue_factor")):
        compared += assert_same_distribution([c.factors[i] for c in ours], [p[key] for p in theirs], key)
    assert compared == 5 * N
    left_out = _ours(v2.ColorJitter(contrast=0.5), n=10)[1]
    assert all(c.factors[0] is None and c.factors[1] is not None and c.factors[2:] == (None, None) for c in left_out)


def test_blur_sigma_follows_torchvisions():
    t = v2.GaussianBlur(kernel_size=(5, 3), sigma=(0.3, 2.5))
    op, ours = _ours(t)
    assert op == Blur(kernel_size=(5, 3), sigma=(0.3, 2.5))
    torch.manual_seed(0)
    theirs = [_make_params(t)["sigma"][0] for _ in range(N)]
    assert assert_same_distribution(ours, theirs, "GaussianBlur sigma") == N


@pytest.mark.parametrize("t, changed", [
    (v2.RandomGrayscale(p=0.3), lambda img, out: not torch.equal(img, out)),
    (v2.RandomVerticalFlip(p=0.7), lambda img, out: not torch.equal(img, out)),
    (v2.RandomAdjustSharpness(sharpness_factor=2.0, p=0.4), lambda img, out: not torch.equal(img, out)),
], ids=["grayscale", "vflip", "sharpness"])
def test_how_often_each_applies_follows_torchvision(t, changed):
    """The rate at which the op applies against torchvision's transform run N times (recovered from whether
    it changed a random image)."""
    _, ours = _ours(t)
    img = torch.randint(0, 256, (3, 6, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    theirs = [changed(img, t(img)) for _ in range(N)]
    assert 0 < sum(theirs) < N
    assert assert_same_frequencies(ours, theirs, type(t).__name__) == N


def _images(n, size=24, seed=3):
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _assert_close(ours, theirs, what, exact=False):
    """Within one level everywhere and 1/255 on average (a sum in another order), or the same pixels."""
    diff = (ours.int() - theirs.int()).abs()
    assert ours.shape == theirs.shape and ours.dtype == torch.uint8, what
    if exact:
        assert int(diff.max()) == 0, what
    assert int(diff.max()) <= 1 and float(diff.float().mean()) <= 1 / 255, (what, int(diff.max()))


def test_jitter_gives_torchvisions_pixels_for_its_draws():
    """64 images, each with its own torchvision draw (order and factors): the batch in one call against
    ColorJitter.transform on each image."""
    t = v2.ColorJitter(brightness=0.5, contrast=0.5, saturation=0.8, hue=0.5)
    images = _images(64)
    torch.manual_seed(1)
    params = [_make_params(t) for _ in range(len(images))]
    choices = [JitterChoice(tuple(p["fn_idx"].tolist()), tuple(p[k] for k in ("brightness_factor", "contrast_factor",
               "saturation_factor", "hue_factor"))) for p in params]
    ours = Jitter(*(t.brightness, t.contrast, t.saturation, t.hue)).apply(images, choices)
    compared = 0
    for i, p in enumerate(params):
        _assert_close(ours[i], t.transform(images[i], p), i)
        compared += 1
    assert compared == 64


@pytest.mark.parametrize("kernel", [(3, 3), (7, 5), (23, 23)])
def test_blur_gives_torchvisions_pixels_for_each_sigma(kernel):
    images = _images(16, size=32)
    sigmas = [0.1 + 0.25 * i for i in range(16)]
    ours = Blur(kernel_size=kernel, sigma=(0.1, 4.0)).apply(images, sigmas)
    theirs = torch.stack([F.gaussian_blur(images[i], list(kernel), [s, s]) for i, s in enumerate(sigmas)])
    _assert_close(ours, theirs, kernel)


def test_grayscale_sharpness_and_flip_give_torchvisions_pixels_where_drawn():
    images = _images(40)
    drawn = [i % 3 == 0 for i in range(40)]
    compared = 0
    for op, fn, exact in ((Grayscale(p=0.5), lambda x: F.rgb_to_grayscale(x, num_output_channels=3), True),
                          (Sharpen(factor=2.5, p=0.5), lambda x: F.adjust_sharpness(x, 2.5), False),
                          (Sharpen(factor=0.2, p=0.5), lambda x: F.adjust_sharpness(x, 0.2), False),
                          (VerticalFlip(p=0.5), F.vertical_flip, True)):
        out = op.apply(images, drawn)
        for i, d in enumerate(drawn):
            _assert_close(out[i], fn(images[i]) if d else images[i], (op, i), exact=exact or not d)
            compared += 1
    assert compared == 4 * 40


@pytest.mark.parametrize("make, message", [
    (lambda: Jitter(hue=(-0.7, 0.0)), r"hue=\(-0.7, 0.0\) needs -0.5 <= low"),
    (lambda: Jitter(brightness=(1.2, 0.8)), r"brightness=\(1.2, 0.8\) needs 0.0 <= low <= high"),
    (lambda: Blur((4, 3)), r"kernel_size=\(4, 3\)\) needs two odd sizes"),
    (lambda: Blur((3, 3), (0.0, 1.0)), r"sigma=\(0.0, 1.0\)\) needs 0 < low"),
    (lambda: Grayscale(1.5), r"RandomGrayscale\(p=1.5\)"),
    (lambda: Sharpen(-1.0), r"sharpness_factor=-1.0\) needs a number >= 0"),
    (lambda: VerticalFlip(-0.1), r"RandomVerticalFlip\(p=-0.1\)"),
])
def test_an_op_with_parameters_torchvision_would_refuse_is_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()
