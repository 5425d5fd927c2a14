"""torchvision's single-function random transforms on uint8 batches: ColorJitter, RandomGrayscale,
GaussianBlur, RandomAdjustSharpness and RandomVerticalFlip, each sample's draws as torchvision's for one
image (the same distributions, in the same order)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Sequence

import torch

from ..params import SampleRandom
from . import pixels
from .pixels import each_group

Range = tuple[float, float]


class JitterChoice(NamedTuple):
    """One sample's ColorJitter: the order of the four functions (0 brightness, 1 contrast, 2 saturation,
    3 hue, as torchvision numbers them) and each one's factor (None where the transform leaves it out)."""

    order: tuple[int, int, int, int]
    factors: tuple[float | None, float | None, float | None, float | None]


_JITTER = (pixels.brightness, pixels.contrast, pixels.saturation, pixels.hue)


def _check_p(owner: str, p: float) -> None:
    if not 0 <= p <= 1:
        raise ValueError(f"{owner}(p={p!r}) needs a probability in [0, 1]")


class _Chance:
    """An op applied to each sample with probability ``p`` (a field of the dataclass): ``p`` is checked as
    torchvision's ``owner`` checks it, and a sample's draw is whether the op applies."""

    owner: ClassVar[str]
    uniforms: ClassVar[int] = 1  # the p draw

    def __post_init__(self) -> None:
        _check_p(self.owner, self.p)

    def draw(self, rnd: SampleRandom, size: int) -> bool:
        return rnd.uniform() < self.p


def _check_range(owner: str, what: str, r: Range | None, low: float, high: float) -> None:
    if r is not None and not low <= r[0] <= r[1] <= high:
        raise ValueError(f"{owner}: {what}={r!r} needs {low} <= low <= high <= {high}")


@dataclass(frozen=True)
class Jitter:
    """``ColorJitter(brightness, contrast, saturation, hue)`` with each given as torchvision holds it, a
    (low, high) range or None: a random order of the four, then each factor uniform over its range."""

    brightness: Range | None = None
    contrast: Range | None = None
    saturation: Range | None = None
    hue: Range | None = None
    salt: ClassVar[int] = 0x7A1B_0003

    def __post_init__(self) -> None:
        for what in ("brightness", "contrast", "saturation"):
            _check_range("ColorJitter", what, getattr(self, what), 0.0, math.inf)
        _check_range("ColorJitter", "hue", self.hue, -0.5, 0.5)

    @property
    def uniforms(self) -> int:
        """Three for the order's shuffle, one per factor given."""
        return 3 + sum(r is not None for r in (self.brightness, self.contrast, self.saturation, self.hue))

    def draw(self, rnd: SampleRandom, size: int) -> JitterChoice:
        order = list(range(4))  # torch.randperm(4): every order equally likely (Fisher-Yates)
        for i in range(3, 0, -1):
            j = rnd.randint(0, i)
            order[i], order[j] = order[j], order[i]
        ranges = (self.brightness, self.contrast, self.saturation, self.hue)
        return JitterChoice(tuple(order), tuple(None if r is None else rnd.uniform(*r) for r in ranges))

    def apply(self, images: torch.Tensor, choices: Sequence[JitterChoice]) -> torch.Tensor:
        """(B, 3, S, S) uint8 -> the same jittered: for each of the four places in the order, one pass per
        function over the samples that put it there, each with its own factor."""
        for k in range(4):
            keys = [c.order[k] if c.factors[c.order[k]] is not None else None for c in choices]
            images = each_group(images, keys, lambda x, fn, members: _JITTER[fn](
                x, [choices[i].factors[fn] for i in members]))
        return images


@dataclass(frozen=True)
class Grayscale(_Chance):
    """``RandomGrayscale(p)``: three equal channels of torchvision's luma, with probability ``p``."""

    p: float = 0.1
    salt: ClassVar[int] = 0x7A1B_0006
    owner: ClassVar[str] = "RandomGrayscale"

    def apply(self, images: torch.Tensor, choices: Sequence[bool]) -> torch.Tensor:
        return each_group(images, choices, lambda x, *_: pixels.grayscale(x), skip=False)


@dataclass(frozen=True)
class Blur:
    """``GaussianBlur(kernel_size, sigma)``: ``kernel_size`` (x, y), odd; sigma uniform over ``sigma``
    (low, high) per sample."""

    kernel_size: tuple[int, int]
    sigma: Range = (0.1, 2.0)
    salt: ClassVar[int] = 0x7A1B_0007
    uniforms: ClassVar[int] = 1  # sigma

    def __post_init__(self) -> None:
        if len(self.kernel_size) != 2 or any(k < 1 or k % 2 == 0 for k in self.kernel_size):
            raise ValueError(f"GaussianBlur(kernel_size={self.kernel_size!r}) needs two odd sizes >= 1")
        if not 0 < self.sigma[0] <= self.sigma[1]:
            raise ValueError(f"GaussianBlur(sigma={self.sigma!r}) needs 0 < low <= high")

    def check_size(self, size: int) -> None:
        """ValueError unless S x S images can be blurred: the reflect padding (half the kernel) must be under S."""
        if max(self.kernel_size) // 2 >= size:
            raise ValueError(f"GaussianBlur(kernel_size={self.kernel_size}) pads by half the kernel, which must be "
                             f"under the image size {size}")

    def draw(self, rnd: SampleRandom, size: int) -> float:
        return rnd.uniform(*self.sigma)

    def apply(self, images: torch.Tensor, choices: Sequence[float]) -> torch.Tensor:
        return pixels.gaussian_blur(images, self.kernel_size, choices)


@dataclass(frozen=True)
class Sharpen(_Chance):
    """``RandomAdjustSharpness(sharpness_factor, p)``: ``adjust_sharpness`` by ``factor`` with probability
    ``p``."""

    factor: float
    p: float = 0.5
    salt: ClassVar[int] = 0x7A1B_0008
    owner: ClassVar[str] = "RandomAdjustSharpness"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.factor >= 0:
            raise ValueError(f"RandomAdjustSharpness(sharpness_factor={self.factor!r}) needs a number >= 0")

    def apply(self, images: torch.Tensor, choices: Sequence[bool]) -> torch.Tensor:
        return each_group(images, choices, lambda x, _, members: pixels.sharpness(x, [self.factor] * len(members)),
                          skip=False)


@dataclass(frozen=True)
class VerticalFlip(_Chance):
    """``RandomVerticalFlip(p)``: upside down with probability ``p``."""

    p: float = 0.5
    salt: ClassVar[int] = 0x7A1B_0009
    owner: ClassVar[str] = "RandomVerticalFlip"

    def apply(self, images: torch.Tensor, choices: Sequence[bool]) -> torch.Tensor:
        return each_group(images, choices, lambda x, *_: x.flip(-2), skip=False)
