"""RandomPerspective per sample on the device (augment.ops.perspective): its pixels against torchvision's
``perspective`` on each textured image for the same corners, and its draws against ``RandomPerspective``'s own
sampler over thousands of samples (a sampler with a planted bug fails the same check)."""

import numpy as np
import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from gpufeed.augment.ops import Apply, Grayscale, Perspective, SampleOps
from gpufeed.augment.ops.perspective import ROWS, coefficients
from gpufeed.augment.params import SampleRandom
from gpufeed.augment.recipe import read_transform

from .helpers import textured
from .stats import assert_same_frequencies

N = 4000
S = 40


def _textured(n: int, size: int = S) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.array(textured(size, size, seed))).permute(2, 0, 1)
                        for seed in range(n)])


def _start(size: int) -> list[list[int]]:
    return [[0, 0], [size - 1, 0], [size - 1, size - 1], [0, size - 1]]


def _read(t) -> Perspective:
    return read_transform(v2.Compose([v2.RandomResizedCrop(S), t])).pixel[0]


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest"])
@pytest.mark.parametrize("fill", [(0.0,), (10.0, 200.0, 30.0), None], ids=["fill0", "fill-rgb", "no-fill"])
def test_the_batch_gives_torchvisions_pixels_for_each_samples_corners(interpolation, fill):
    """96 textured images, each with its own corners (a quarter of them not warped, the rest more than
    ``ROWS``, warped a part at a time): bit for bit what ``F.perspective(image, startpoints, corners,
    interpolation, fill)`` gives the uint8 tensor."""
    images = _textured(96)
    op = Perspective(distortion_scale=0.7, p=0.75, interpolation=interpolation, fill=fill)
    choices = SampleOps.draws(op, range(96), seed=4, epoch=0, size=S)
    assert ROWS < sum(c is not None for c in choices) < 96
    out = op.apply(images, choices)
    assert out.shape == images.shape and out.dtype == torch.uint8
    mode = v2.InterpolationMode(interpolation)
    their_fill = None if fill is None else list(fill) if len(fill) == 3 else fill[0]
    warped = 0
    for image, got, corners in zip(images, out, choices, strict=True):
        if corners is None:
            assert torch.equal(got, image)
            continue
        want = F.perspective(image, _start(S), [list(c) for c in corners], interpolation=mode, fill=their_fill)
        assert torch.equal(got, want), corners
        warped += not torch.equal(got, image)
    assert warped == sum(c is not None for c in choices)


def test_the_coefficients_are_torchvisions_least_squares():
    from torchvision.transforms.functional import _get_perspective_coeffs

    with pytest.warns(UserWarning, match="distortion_scale=1"):
        op = Perspective(distortion_scale=1.0, p=1.0)
    corners = [op.draw(SampleRandom(2, 0, i), 57) for i in range(64)]
    ours = coefficients(corners, 57, 57)
    theirs = np.array([_get_perspective_coeffs(_start(57), [list(c) for c in cs]) for cs in corners], np.float32)
    assert np.array_equal(ours, theirs)


def test_corners_that_collapse_the_image_are_named():
    """Only distortion_scale=1 can draw them (torchvision's solve fails there too)."""
    fine = ((0, 0), (56, 0), (56, 56), (0, 56))
    with pytest.raises(ValueError, match=r"corners \(\(28, 28\), \(28, 28\).* below 1"):
        coefficients([fine, ((28, 28),) * 4], 57, 57)


@pytest.mark.parametrize("wrap", [lambda op: op, lambda op: Apply((Grayscale(0.5), op), p=0.9)],
                         ids=["alone", "in-random-apply"])
def test_a_draw_that_collapses_the_image_names_its_sample_and_the_way_out(wrap):
    """distortion_scale=1 warns when the op is made; a batch whose sample drew corners that collapse a 9 x 9
    image (one draw in some 200 there) fails naming the sample, its epoch and the seed, alone or in a
    container, and that sample alone fails the same way."""
    with pytest.warns(UserWarning, match=r"distortion_scale=1\) can draw corners that collapse .* below 1"):
        op = wrap(Perspective(distortion_scale=1.0, p=1.0))
    ops = SampleOps(pixel=(op,), mean=(0.5,) * 3, std=(0.25,) * 3)
    images = _textured(64, 9)

    def run(indices):
        ops.from_pixels(images[: len(indices)], indices, seed=7, epoch=2, dtype=torch.float32, channels_last=False)

    with pytest.raises(ValueError, match=r"^sample (\d+) of epoch 2 \(seed 7\): RandomPerspective drew the "
                                         r"corners .* collapse the image .* below 1") as failed:
        for start in range(0, 2048, 64):
            run(range(start, start + 64))
    index = int(failed.value.args[0].split()[1])
    with pytest.raises(ValueError, match=rf"^sample {index} of epoch 2"):
        run([index])
    run([index + 1] if index % 64 < 63 else [index - 1])  # its neighbour warps


def _corners_from(coeffs: list[float], size: int) -> tuple[int, ...]:
    """The corners torchvision drew, from the coefficients ``make_params`` returns: the homography they hold
    maps the corners to the image's, so its inverse maps the image's corners back to them."""
    a, b, c, d, e, f, g, h = coeffs
    back = np.linalg.inv(np.array([[a, b, c], [d, e, f], [g, h, 1.0]]))
    points = back @ np.array([[x, y, 1.0] for x, y in _start(size)]).T
    return tuple(int(v) for v in np.rint(points[:2] / points[2]).T.ravel())


def _theirs(t, n: int, size: int) -> list[tuple[int, ...] | None]:
    """torchvision's draws for n images: None where ``RandomPerspective`` left the image as it is, else the
    corners (x, y of each) its ``make_params`` drew, in the order the transform draws them."""
    image = torch.zeros(3, size, size, dtype=torch.uint8)
    torch.manual_seed(0)
    out = []
    for _ in range(n):
        if torch.rand(1) >= t.p:  # _RandomApplyTransform.forward's draw
            out.append(None)
            continue
        out.append(_corners_from(t.make_params([image])["coefficients"], size))
    return out


def _flat(c):
    return None if c is None else tuple(v for corner in c for v in corner)


def _compare(ours, theirs, what) -> int:
    compared = assert_same_frequencies([c is None for c in ours], [c is None for c in theirs], f"{what} p")
    drawn, drawn_theirs = [c for c in ours if c is not None], [c for c in theirs if c is not None]
    for k in range(8):  # each corner coordinate's distribution
        assert_same_frequencies([c[k] for c in drawn], [c[k] for c in drawn_theirs], f"{what} coordinate {k}")
    return compared


def test_the_draws_follow_random_perspectives_own_sampler():
    """How often the warp applies, and each of the 8 corner coordinates, against ``make_params`` (its corners
    recovered from its coefficients) over N samples."""
    t = v2.RandomPerspective(distortion_scale=0.6, p=0.3)
    op = _read(t)
    assert op == Perspective(distortion_scale=0.6, p=0.3, interpolation="bilinear", fill=(0.0,))
    ours = [_flat(c) for c in SampleOps.draws(op, range(N), seed=5, epoch=1, size=S)]
    theirs = _theirs(t, N, S)
    assert _compare(ours, theirs, "RandomPerspective") == N
    assert max(c[0] for c in theirs if c is not None) == int(0.6 * (S // 2))  # the bound is reached


class _OffByOne(Perspective):
    """A planted bug: each corner may move one pixel further than torchvision lets it."""

    def draw(self, rnd, size):
        if rnd.uniform() >= self.p:
            return None
        bound = int(self.distortion_scale * (size // 2)) + 2
        near, far = (0, bound - 1), (size - bound, size - 1)
        return ((rnd.randint(*near), rnd.randint(*near)), (rnd.randint(*far), rnd.randint(*near)),
                (rnd.randint(*far), rnd.randint(*far)), (rnd.randint(*near), rnd.randint(*far)))


@pytest.mark.parametrize("planted", [
    lambda: _OffByOne(distortion_scale=0.6, p=0.3),
    lambda: Perspective(distortion_scale=0.6, p=1 - 0.3),  # applied where torchvision leaves the image
], ids=["corner-bound", "p-inverted"])
def test_a_sampler_with_a_planted_bug_fails_the_same_check(planted):
    t = v2.RandomPerspective(distortion_scale=0.6, p=0.3)
    ours = [_flat(c) for c in SampleOps.draws(planted(), range(N), seed=5, epoch=1, size=S)]
    with pytest.raises(AssertionError, match="drawn"):
        _compare(ours, _theirs(t, N, S), "planted")


def test_the_settings_are_read_from_either_torchvision_api():
    from torchvision import transforms as v1
    from torchvision import tv_tensors

    assert _read(v1.RandomPerspective(0.2, p=0.9, interpolation=v1.InterpolationMode.NEAREST, fill=[1, 2, 3])) == \
        Perspective(distortion_scale=0.2, p=0.9, interpolation="nearest", fill=(1.0, 2.0, 3.0))
    # a fill per input type: the PIL image's, as a Dataset hands it over before ToImage
    by_type = v2.RandomPerspective(fill={tv_tensors.Image: 9, "others": 7})
    assert _read(by_type).fill == (7.0,)
    assert read_transform(v2.Compose([v2.RandomResizedCrop(S), v2.ToImage(), by_type, v2.ToDtype(
        torch.float32, scale=True)])).pixel[0].fill == (9.0,)
    assert _read(v2.RandomPerspective(fill=None)).fill is None


def test_bicubic_runs_in_the_workers_and_bad_settings_are_refused():
    recipe = read_transform(v2.Compose([v2.RandomResizedCrop(S), v2.RandomPerspective(
        interpolation=v2.InterpolationMode.BICUBIC)]))
    assert recipe.pixel == () and recipe.workers.own == ("RandomPerspective",) and recipe.workers.placed == ()
    for make, message in ((lambda: Perspective(distortion_scale=1.5), r"distortion_scale=1.5\) needs a value in"),
                          (lambda: Perspective(p=-0.1), r"p=-0.1\) needs a probability"),
                          (lambda: Perspective(interpolation="bicubic"), "with nearest or bilinear"),
                          (lambda: Perspective(fill=(1.0, 2.0)), "one value or one per channel")):
        with pytest.raises(ValueError, match=message):
            make()
