"""Per-sample augmentation parameters: one generator for every backend.

Each sample's parameters are a pure function of (seed, epoch, sample index,
image size), drawn from a counter-based generator (SplitMix64). Whichever
worker, process or device handles a sample, it crops the same box and makes
the same flip decision, so CPU and GPU runs of one seed agree and a resumed
epoch repeats exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Sequence

import numpy as np

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """``_splitmix64`` of each element of a uint64 array (numpy's uint64 arithmetic wraps, as the mask does)."""
    x = x + np.uint64(_GAMMA)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


AHEAD = 8  # uniforms computed ahead per sample for an op that declares none: most ops' draws take at most 8


class SampleRandom:
    """A stream of uniform floats in [0, 1) keyed by (seed, epoch, index)."""

    __slots__ = ("_state",)

    def __init__(self, seed: int, epoch: int, index: int) -> None:
        self._state = _splitmix64(_splitmix64(_splitmix64(seed & _MASK) ^ (epoch & _MASK)) ^ (index & _MASK))

    @staticmethod
    def streams(seed: int, epoch: int, indices: Sequence[int], ahead: int | None = None) -> list[SampleRandom]:
        """``SampleRandom(seed, epoch, i)`` for each ``i`` of ``indices``, each stream's first ``ahead`` uniforms
        computed for all of them at once with numpy: the same numbers, for a fraction of the Python that a
        batch's draws cost one sample at a time in the process that trains. Indices in [0, 2**63); ``ahead``
        None: ``AHEAD``."""
        ahead = AHEAD if ahead is None else ahead
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        with np.errstate(over="ignore"):
            keyed = np.uint64(_splitmix64(_splitmix64(seed & _MASK) ^ (epoch & _MASK)))
            start = _splitmix64_array(np.asarray(indices, dtype=np.int64).astype(np.uint64) ^ keyed)
            states = start[:, None] + np.arange(1, ahead + 1, dtype=np.uint64) * np.uint64(_GAMMA)
            uniforms = (_splitmix64_array(states) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
            last = states[:, -1] if ahead else start
        # one list of every stream's uniforms, not a list and an iterator per stream: three objects the
        # garbage collector tracks per sample would set off a collection for nearly every op of every batch
        # in the process that trains (BENCHMARKS.md, "Training recipes")
        drawn = uniforms.ravel().tolist()
        out = []
        for k, state in enumerate(last.tolist()):
            rnd = _Ahead.__new__(_Ahead)
            rnd._state, rnd._drawn, rnd._at, rnd._end = state, drawn, k * ahead, (k + 1) * ahead
            out.append(rnd)
        return out

    def uniform(self, low: float = 0.0, high: float = 1.0) -> float:
        self._state = (self._state + _GAMMA) & _MASK
        return low + (high - low) * (_splitmix64(self._state) >> 11) * (1.0 / (1 << 53))

    def randint(self, low: int, high: int) -> int:
        """An integer in [low, high] inclusive."""
        return low + min(int(self.uniform() * (high - low + 1)), high - low)

    def normal(self) -> float:
        """A standard normal draw (Box-Muller, from two uniforms)."""
        radius = math.sqrt(-2.0 * math.log(1.0 - self.uniform()))
        return radius * math.cos(2.0 * math.pi * self.uniform())

    def gamma(self, shape: float) -> float:
        """A Gamma(``shape``, 1) draw, ``shape`` > 0: Marsaglia and Tsang's method (shapes below 1 through
        Gamma(shape + 1) times U ** (1 / shape))."""
        if shape < 1.0:
            return self.gamma(shape + 1.0) * (1.0 - self.uniform()) ** (1.0 / shape)
        d = shape - 1.0 / 3.0
        c = 1.0 / math.sqrt(9.0 * d)
        while True:
            x = self.normal()
            v = (1.0 + c * x) ** 3
            if v > 0 and math.log(1.0 - self.uniform()) < 0.5 * x * x + d - d * v + d * math.log(v):
                return d * v

    def dirichlet(self, alphas: Sequence[float]) -> list[float]:
        """A Dirichlet(``alphas``) draw: Gamma draws normalised to sum to 1."""
        draws = [self.gamma(a) for a in alphas]
        total = sum(draws)
        return [g / total for g in draws]


class _Ahead(SampleRandom):
    """A ``SampleRandom`` whose next uniforms were computed ahead (``SampleRandom.streams``); past them it
    goes on from the state after the last."""

    __slots__ = ("_drawn", "_at", "_end")  # the batch's uniforms, this stream's next and end in them

    def uniform(self, low: float = 0.0, high: float = 1.0) -> float:
        at = self._at
        if at == self._end:
            return SampleRandom.uniform(self, low, high)
        self._at = at + 1
        return low + (high - low) * self._drawn[at]  # (high - low) * (x * 2**-53) is (high - low) * x * 2**-53 exactly

    def randint(self, low: int, high: int) -> int:
        """``SampleRandom.randint``'s integer, from the next uniform computed ahead without a second call."""
        at = self._at
        if at == self._end:
            return SampleRandom.randint(self, low, high)
        self._at = at + 1
        return low + min(int(self._drawn[at] * (high - low + 1)), high - low)


@dataclass(frozen=True)
class CropBox:
    """A crop of the source image in its own pixel coordinates, and a flip flag."""

    x: int
    y: int
    width: int
    height: int
    flip: bool = False


class ResizeCrop(NamedTuple):
    """Validation geometry: the whole image resized to ``width`` x ``height``, then the square crop at
    (``left``, ``top``) of that resized image."""

    width: int
    height: int
    left: int
    top: int


PADDING_MODES = ("constant", "edge", "reflect", "symmetric")


@dataclass(frozen=True)
class RandomCrop:
    """torchvision's ``RandomCrop(image_size, padding, pad_if_needed, fill, padding_mode)``, after
    ``Resize(resize_size)`` when ``resize``: the training crop taken from the (resized) image as it is, no
    resampling. ``padding``: (left, top, right, bottom) pixels; ``fill``: the constant padding's RGB;
    ``two_steps``: what ``pad_if_needed`` adds is padded after ``padding``, as ``torchvision.transforms``
    pads it (v2 pads both at once: the same pixels but where reflect or symmetric padding reflects the
    first padding)."""

    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    pad_if_needed: bool = False
    fill: tuple[int, int, int] = (0, 0, 0)
    padding_mode: str = "constant"
    resize: bool = False
    two_steps: bool = False

    def __post_init__(self) -> None:
        if len(self.padding) != 4 or any(not isinstance(p, int) or p < 0 for p in self.padding):
            raise ValueError(f"RandomCrop padding must be 4 whole numbers >= 0 (left, top, right, bottom), "
                             f"got {self.padding!r}")
        if len(self.fill) != 3 or any(not isinstance(v, int) or not 0 <= v <= 255 for v in self.fill):
            raise ValueError(f"RandomCrop fill must be 3 whole numbers in [0, 255] (uint8 RGB), got {self.fill!r}")
        if self.padding_mode not in PADDING_MODES:
            raise ValueError(f"RandomCrop padding_mode must be one of {PADDING_MODES}, got {self.padding_mode!r}")


class RandomCropAt(NamedTuple):
    """Where one sample's RandomCrop falls: the image at ``width`` x ``height`` (resized, or its own size),
    padded by ``padding`` (left, top, right, bottom), the square at (``left``, ``top``) of the padded image,
    flipped or not."""

    width: int
    height: int
    padding: tuple[int, int, int, int]
    left: int
    top: int
    flip: bool


def default_resize_size(image_size: int) -> int:
    """Validation's shorter side before the centre crop, as torchvision's ImageNet recipe scales it (256 for 224)."""
    return round(image_size * 256 / 224)


@dataclass(frozen=True)
class AugmentSpec:
    """How training and validation samples become ``image_size`` squares.

    Train (``draw``): RandomResizedCrop with torchvision's parameter distribution
    (area ``scale``, log-uniform aspect ``ratio``, 10 tries, then the central
    fallback) and a horizontal flip with probability ``hflip``.
    Validation (``resize_crop``): torchvision's ``Resize(resize_size)`` then
    ``CenterCrop(image_size)``, with their rounding. With ``crop`` (training, ``random_crop``):
    torchvision's ``RandomCrop`` in place of RandomResizedCrop, after ``Resize(resize_size)`` if the crop
    says so, then the flip.
    """

    train: bool = True
    image_size: int = 224
    resize_size: int = 256
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    crop: RandomCrop | None = None

    def __post_init__(self) -> None:
        if self.image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {self.image_size}")
        if self.crop is not None and not self.train:
            raise ValueError("RandomCrop is a training crop; validation resizes and centre-crops")
        if self.crop is not None and self.crop.resize and not self.crop.pad_if_needed:
            left, top, right, bottom = self.crop.padding
            if self.resize_size + max(left + right, top + bottom) < self.image_size:
                raise ValueError(f"Resize({self.resize_size}) and RandomCrop's padding {self.crop.padding} leave every "
                                 f"image smaller than RandomCrop({self.image_size})")
        if self.crop is None and self.resize_size < self.image_size:
            raise ValueError(f"resize_size must be >= image_size ({self.image_size}), got {self.resize_size}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < low <= high <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < low <= high, got {self.ratio}")
        if not 0 <= self.hflip <= 1:
            raise ValueError(f"hflip must be in [0, 1], got {self.hflip}")

    def at_size(self, image_size: int, resize_size: int | None = None) -> "AugmentSpec":
        """The same augmentation making ``image_size`` squares (progressive resizing); validation resizes to
        ``resize_size`` first (default: this one's ratio of resize to crop, 256/224 unless it was given
        another, so an explicit ``Resize(232) + CenterCrop(224)`` keeps its ratio at every size)."""
        if resize_size is None:  # a RandomCrop with padding may crop more than its Resize leaves
            resize_size = max(image_size if self.crop is None else 1,
                              round(image_size * self.resize_size / self.image_size))
        if (image_size, resize_size) == (self.image_size, self.resize_size):
            return self
        return replace(self, image_size=image_size, resize_size=resize_size)

    @property
    def box_crop(self) -> bool:
        """Whether the crop is a resampled box (training's RandomResizedCrop, ``draw``): the one crop the GPU
        decoders' fused kernel makes; validation's Resize + CenterCrop has its own (``augment.center_crop``), and the
        CPU workers make RandomCrop's."""
        return self.train and self.crop is None

    def draw(self, width: int, height: int, *, seed: int, epoch: int, index: int) -> CropBox:
        """The training crop box for sample ``index`` of ``epoch`` in an image of ``width`` x ``height``."""
        if not self.box_crop:
            raise ValueError("this recipe does not crop by a resampled box: "
                             + ("RandomCrop (random_crop)" if self.train else "validation (resize_crop)"))
        rnd = SampleRandom(seed, epoch, index)
        x, y, w, h = random_resized_crop(width, height, self.scale, self.ratio, rnd)
        return CropBox(x, y, w, h, flip=rnd.uniform() < self.hflip)

    def resize_crop(self, width: int, height: int) -> ResizeCrop:
        """Where ``Resize(resize_size)`` + ``CenterCrop(image_size)`` take a ``width`` x ``height`` image:
        the shorter side to ``resize_size``, the longer truncated as torchvision computes it, the crop's
        offsets rounded as ``CenterCrop`` rounds them."""
        if self.train:
            raise ValueError("resize_crop is validation's geometry; this recipe trains")
        new_w, new_h = self._resized(width, height)
        left = int(round((new_w - self.image_size) / 2.0))
        top = int(round((new_h - self.image_size) / 2.0))
        return ResizeCrop(new_w, new_h, left, top)

    def center_box(self, width: int, height: int) -> CropBox:
        """Validation: the part of a ``width`` x ``height`` image that ``resize_crop``'s square is made from,
        rounded out to whole pixels (the box the CPU's cost model weighs: ``placement.cpu_cost``)."""
        g = self.resize_crop(width, height)
        sx, sy = width / g.width, height / g.height
        x, y = int(g.left * sx), int(g.top * sy)
        s = self.image_size
        return CropBox(x, y, min(width - x, math.ceil(s * sx)), min(height - y, math.ceil(s * sy)))

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        """``Resize(resize_size)``'s output size: the shorter side to ``resize_size``, the longer truncated."""
        short, long = min(width, height), max(width, height)
        new_short, new_long = self.resize_size, int(self.resize_size * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)

    def random_crop(self, width: int, height: int, *, seed: int, epoch: int, index: int) -> RandomCropAt:
        """The RandomCrop of sample ``index`` of ``epoch`` in an image of ``width`` x ``height``, as
        torchvision's ``RandomCrop.make_params`` draws it: the padding, grown on both sides by what
        ``pad_if_needed`` lacks, then the top and the left uniform over the padded image (0 where it is the
        crop's size); then the flip. ValueError, naming both sizes, where the crop is larger than that."""
        crop, s = self.crop, self.image_size
        if crop is None:
            raise ValueError("this recipe crops with RandomResizedCrop (draw), not RandomCrop")
        w, h = self._resized(width, height) if crop.resize else (width, height)
        left, top, right, bottom = crop.padding
        if crop.pad_if_needed:
            grow_y, grow_x = max(0, s - (h + top + bottom)), max(0, s - (w + left + right))
            top, bottom, left, right = top + grow_y, bottom + grow_y, left + grow_x, right + grow_x
        padded_w, padded_h = w + left + right, h + top + bottom
        if padded_w < s or padded_h < s:
            raise ValueError(f"RandomCrop({s}) is larger than the {'padded ' if any(crop.padding) else ''}image "
                             f"({padded_w} x {padded_h})")
        rnd = SampleRandom(seed, epoch, index)
        y = rnd.randint(0, padded_h - s) if padded_h > s else 0
        x = rnd.randint(0, padded_w - s) if padded_w > s else 0
        return RandomCropAt(w, h, (left, top, right, bottom), x, y, rnd.uniform() < self.hflip)


def random_resized_crop(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], rnd: SampleRandom
) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``, drawing from ``rnd``: (x, y, w, h)."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * rnd.uniform(scale[0], scale[1])
        aspect = math.exp(rnd.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rnd.randint(0, width - w), rnd.randint(0, height - h), w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h
