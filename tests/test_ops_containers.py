"""RandomApply, RandomChoice and RandomOrder of device ops, per sample on the device
(augment.ops.containers): their draws against torchvision's containers run thousands of times (what each did
recovered from its pixels), and their pixels against torchvision's functional ops in the drawn order."""

import itertools

import numpy as np
import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from gpufeed.augment.ops import Apply, Blur, Choice, Grayscale, Jitter, Order, Perspective, SampleOps, VerticalFlip
from gpufeed.augment.params import SampleRandom
from gpufeed.augment.recipe import read_transform

from .helpers import textured
from .stats import assert_same_frequencies

N = 3000
S = 12


def _image(size: int = S, seed: int = 1) -> torch.Tensor:
    return torch.from_numpy(np.array(textured(size, size, seed))).permute(2, 0, 1).contiguous()


def _read(t):
    return read_transform(v2.Compose([v2.RandomResizedCrop(S), t])).pixel[0]


def _draws(op, n=N):
    return SampleOps.draws(op, range(n), seed=7, epoch=2, size=S)


# three ops whose six orders give six different images (and each alone another image)
DARKEN, GREY = v2.ColorJitter(brightness=(0.5, 0.5)), v2.RandomGrayscale(p=1.0)
SHARPEN = v2.RandomAdjustSharpness(3.0, p=1.0)
FUNCTIONS = (lambda x: F.adjust_brightness(x, 0.5), lambda x: F.rgb_to_grayscale(x, num_output_channels=3),
             lambda x: F.adjust_sharpness(x, 3.0))


def _which(out: torch.Tensor, candidates: dict) -> object:
    """The one key of ``candidates`` whose image ``out`` is."""
    found = [k for k, image in candidates.items() if torch.equal(out, image)]
    assert len(found) == 1, found
    return found[0]


def _theirs(t, candidates: dict, n=N) -> list:
    image = _image()
    torch.manual_seed(0)
    return [_which(t(image), candidates) for _ in range(n)]


def _compose(image, order):
    for k in order:
        image = FUNCTIONS[k](image)
    return image


def test_random_apply_applies_as_often_as_torchvisions():
    t = v2.RandomApply([DARKEN, GREY], p=0.3)
    op = _read(t)
    assert isinstance(op, Apply) and op.p == 0.3 and len(op.ops) == 2
    image = _image()
    theirs = _theirs(t, {True: _compose(image, (0, 1)), False: image})
    assert assert_same_frequencies([c is not None for c in _draws(op)], theirs, "RandomApply") == N


def test_random_choice_picks_each_op_as_often_as_torchvisions():
    t = v2.RandomChoice([DARKEN, GREY, SHARPEN], p=[2, 5, 3])
    op = _read(t)
    assert isinstance(op, Choice) and len(op.ops) == 3
    image = _image()
    theirs = _theirs(t, {k: FUNCTIONS[k](image) for k in range(3)})
    assert assert_same_frequencies([c.at for c in _draws(op)], theirs, "RandomChoice") == N
    planted = Choice(op.ops, p=(3, 5, 2), salt=op.salt)  # a planted bug: the weights reversed
    with pytest.raises(AssertionError, match="drawn"):
        assert_same_frequencies([c.at for c in _draws(planted)], theirs, "planted")


def test_random_order_draws_every_order_as_often_as_torchvisions():
    t = v2.RandomOrder([DARKEN, GREY, SHARPEN])
    op = _read(t)
    assert isinstance(op, Order)
    image = _image()
    orders = list(itertools.permutations(range(3)))
    theirs = _theirs(t, {o: _compose(image, o) for o in orders})
    ours = [c.order for c in _draws(op)]
    assert set(ours) == set(orders)
    assert assert_same_frequencies(ours, theirs, "RandomOrder") == N


@pytest.mark.parametrize("make", [
    lambda ops: Apply(ops, p=1.0),
    lambda ops: Choice(ops[:1], p=(1.0,)),
    lambda ops: Choice(ops, p=(1.0, 0.0, 0.0)),
    lambda ops: Order(ops),
    lambda ops: Apply((Order(ops), Choice(ops, p=(1.0, 0.0, 0.0))), p=1.0),
])
def test_a_containers_uniforms_are_what_its_longest_draw_takes(make):
    """``uniforms`` counts the container's own draws and its inner ops' (a warp that always warps and a jitter
    of all four factors: their longest draws), so a batch's draws come from the uniforms computed ahead: a
    sample's draw leaves its stream exactly ``uniforms`` numbers on, with the draws of a stream computed ahead
    and of a plain one the same."""
    op = make((Perspective(0.5, p=1.0), Jitter((0.5, 1.5), (0.5, 1.5), (0.5, 1.5), (-0.1, 0.1)), VerticalFlip()))
    for index, ahead in zip(range(50), SampleRandom.streams(9 ^ op.salt, 1, range(50), op.uniforms)):
        plain, rest = SampleRandom(9 ^ op.salt, 1, index), SampleRandom(9 ^ op.salt, 1, index)
        assert op.draw(ahead, S) == op.draw(plain, S)
        for _ in range(op.uniforms):
            rest.uniform()
        assert plain.uniform() == rest.uniform() == ahead.uniform()


def _textured(n, size=32):
    return torch.stack([_image(size, seed) for seed in range(n)])


def _perspective(image, corners):
    start = [[0, 0], [31, 0], [31, 31], [0, 31]]
    return image if corners is None else F.perspective(image, start, [list(c) for c in corners], fill=0)


def test_each_container_gives_torchvisions_pixels_for_its_draws():
    """24 textured images through each container of RandomPerspective, RandomVerticalFlip and ColorJitter:
    each sample as torchvision's functional ops give it for the sample's draw, in the drawn order."""
    images = _textured(24)
    warp, flip, jitter = Perspective(0.5, p=1.0), VerticalFlip(p=0.5), Jitter(brightness=(0.5, 1.5))
    one = {"warp": lambda x, d: _perspective(x, d), "flip": lambda x, d: F.vertical_flip(x) if d else x,
           "jitter": lambda x, d: F.adjust_brightness(x, d.factors[0])}
    names = ("warp", "flip", "jitter")
    compared = 0
    for op in (Apply((warp, flip, jitter), p=0.6), Choice((warp, flip, jitter), p=(1.0, 1.0, 1.0)),
               Order((warp, flip, jitter))):
        choices = SampleOps.draws(op, range(24), seed=3, epoch=0, size=32)
        out = op.apply(images, choices)
        for image, got, c in zip(images, out, choices, strict=True):
            if isinstance(op, Apply):
                steps = [] if c is None else list(zip(names, c))
            elif isinstance(op, Choice):
                steps = [(names[c.at], c.draw)]
            else:
                steps = [(names[k], c.draws[k]) for k in c.order]
            want = image
            for name, d in steps:
                want = one[name](want, d)
            diff = (got.int() - want.int()).abs()
            assert int(diff.max()) <= 1, (op, c)  # ColorJitter's blend: within one level, as its own test
            compared += 1
    assert compared == 72


def test_containers_stream_apart_and_nest():
    """Two RandomApply of one recipe draw apart from each other; a container within a container, and a Compose
    within one, are read through; one holding an op without a device version runs in the workers whole."""
    recipe = read_transform(v2.Compose([
        v2.RandomResizedCrop(S), v2.RandomApply([v2.ColorJitter(0.4)], p=0.5),
        v2.RandomApply([v2.Compose([v2.RandomGrayscale(1.0), v2.RandomChoice([v2.GaussianBlur(3),
                                                                               v2.RandomPerspective()])])], p=0.5),
        v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]))
    first, second = recipe.pixel
    assert first.salt != second.salt and isinstance(second.ops[1], Choice) and isinstance(second.ops[0], Grayscale)
    a, b = ([c is None for c in _draws(op, 400)] for op in (first, second))
    assert a != b
    assert recipe.device == ("RandomApply", "RandomApply") and recipe.workers is None
    away = read_transform(v2.Compose([v2.RandomResizedCrop(S), v2.RandomApply([v2.GaussianBlur(3),
                                                                                v2.RandomRotation(10)])]))
    assert away.pixel == () and away.workers.own == ("RandomApply",)


def test_a_container_of_flip_commuting_ops_may_stand_before_the_flip():
    before = read_transform(v2.Compose([v2.RandomResizedCrop(S), v2.RandomApply([v2.ColorJitter(0.4)]),
                                        v2.RandomHorizontalFlip()]))
    assert before.workers is None and before.hflip == 0.5 and before.device == ("RandomApply",)
    warped = read_transform(v2.Compose([v2.RandomResizedCrop(S), v2.RandomApply([v2.RandomPerspective()]),
                                        v2.RandomHorizontalFlip()]))
    assert warped.workers.names == ("RandomApply", "RandomHorizontalFlip") and warped.workers.placed == ("RandomApply",)


def test_the_image_size_is_checked_for_a_containers_ops_nested_too():
    """A GaussianBlur whose padding the image cannot take is refused inside a container within a container,
    as alone; one the image can take passes."""
    nested = SampleOps(pixel=(Apply((Choice((Grayscale(), Blur((9, 9))), p=(1.0, 1.0)),), p=0.5),),
                       mean=(0.5,) * 3, std=(0.25,) * 3)
    nested.check_size(5)
    with pytest.raises(ValueError, match=r"GaussianBlur\(kernel_size=\(9, 9\)\) pads .* image size 4"):
        nested.check_size(4)


@pytest.mark.parametrize("make, message", [
    (lambda: Apply((), p=0.5), "RandomApply needs at least one op"),
    (lambda: Apply((Grayscale(),), p=1.5), r"p=1.5"),
    (lambda: Choice((Grayscale(),), p=(0.0,)), r"not all 0, got p=\[0.0\]"),
    (lambda: Choice((Grayscale(), VerticalFlip()), p=(1.0,)), r"one weight >= 0 per op"),
    (lambda: Order(()), "RandomOrder needs at least one op"),
])
def test_bad_settings_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()
