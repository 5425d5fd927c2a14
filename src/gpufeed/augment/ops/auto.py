"""The auto-augment family on uint8 batches: TrivialAugmentWide, RandAugment, AutoAugment and AugMix, one
table of operations for all four, each sample's operations drawn as torchvision draws them for one image.

A sample's choice is a tuple of steps ``(operation, signed magnitude)``, as many for every sample of an op
(a step AutoAugment's policy skipped, or past the end of a shorter AugMix chain, is ``Identity``). Each
step runs on the batch as one pass per operation for all the samples that drew it, each with its own
magnitude (``apply_operations``), giving torchvision's pixels for each sample, but for rare one-level
steps where a blend's sum lands on a whole level (``pixels``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple, Sequence

import torch
from torchvision.transforms.v2 import functional as F

from ..params import SampleRandom
from . import kernels, pixels
from .pixels import BATCHED_GEOMETRY, each_group, on

Step = tuple[str, float]  # (operation, signed magnitude)
IDENTITY: Step = ("Identity", 0.0)


def _linspace(low: float, high: float) -> Callable[[int, int], torch.Tensor]:
    return lambda bins, size: torch.linspace(low, high, bins)


def _bits(top: int, spread: int) -> Callable[[int, int], torch.Tensor]:
    return lambda bins, size: (top - (torch.arange(bins) / ((bins - 1) / spread))).round().int()


def _translate(bins: int, size: int) -> torch.Tensor:
    return torch.linspace(0.0, 150.0 / 331.0 * size, bins)


_NONE = (None, False)
# torchvision's augmentation spaces, in its order (the index a sample draws): operation -> (magnitudes by bin
# for (num_bins, image size), or None; signed)
WIDE = {  # TrivialAugmentWide
    "Identity": _NONE, "ShearX": (_linspace(0.0, 0.99), True), "ShearY": (_linspace(0.0, 0.99), True),
    "TranslateX": (_linspace(0.0, 32.0), True), "TranslateY": (_linspace(0.0, 32.0), True),
    "Rotate": (_linspace(0.0, 135.0), True), "Brightness": (_linspace(0.0, 0.99), True),
    "Color": (_linspace(0.0, 0.99), True), "Contrast": (_linspace(0.0, 0.99), True),
    "Sharpness": (_linspace(0.0, 0.99), True), "Posterize": (_bits(8, 6), False),
    "Solarize": (_linspace(1.0, 0.0), False), "AutoContrast": _NONE, "Equalize": _NONE,
}
STANDARD = {  # RandAugment (all but Invert) and AutoAugment (all but Identity)
    "Identity": _NONE, "ShearX": (_linspace(0.0, 0.3), True), "ShearY": (_linspace(0.0, 0.3), True),
    "TranslateX": (_translate, True), "TranslateY": (_translate, True), "Rotate": (_linspace(0.0, 30.0), True),
    "Brightness": (_linspace(0.0, 0.9), True), "Color": (_linspace(0.0, 0.9), True),
    "Contrast": (_linspace(0.0, 0.9), True), "Sharpness": (_linspace(0.0, 0.9), True),
    "Posterize": (_bits(8, 4), False), "Solarize": (_linspace(1.0, 0.0), False), "AutoContrast": _NONE,
    "Equalize": _NONE, "Invert": _NONE,
}
_AUGMIX_BASIC = {  # AugMix without all_ops
    "ShearX": (_linspace(0.0, 0.3), True), "ShearY": (_linspace(0.0, 0.3), True),
    "TranslateX": (lambda bins, size: torch.linspace(0.0, size / 3.0, bins), True),
    "TranslateY": (lambda bins, size: torch.linspace(0.0, size / 3.0, bins), True),
    "Rotate": (_linspace(0.0, 30.0), True), "Posterize": (_bits(4, 4), False),
    "Solarize": (_linspace(1.0, 0.0), False), "AutoContrast": _NONE, "Equalize": _NONE,
}
AUGMIX = {**_AUGMIX_BASIC, "Brightness": (_linspace(0.0, 0.9), True), "Color": (_linspace(0.0, 0.9), True),
          "Contrast": (_linspace(0.0, 0.9), True), "Sharpness": (_linspace(0.0, 0.9), True)}
_SPACES = {"wide": WIDE, "standard": STANDARD, "augmix": AUGMIX}
_WIDE_NAMES = tuple(WIDE)
_RAND_NAMES = tuple(n for n in STANDARD if n != "Invert")
OPERATIONS = tuple(STANDARD)  # every operation the table runs


@functools.lru_cache(maxsize=256)
def magnitudes(space: str, name: str, bins: int, size: int) -> tuple[float, ...] | None:
    """The magnitude of each bin of ``name`` in ``space`` ("wide", "standard" or "augmix") for ``size``
    images."""
    fn = _SPACES[space][name][0]
    return None if fn is None else tuple(float(m) for m in fn(bins, size))


def _step(rnd: SampleRandom, space: str, name: str, bins: int, size: int, pick: Callable[[], int]) -> Step:
    """``name`` with the magnitude of bin ``pick()`` (drawn only where it has magnitudes), then the sign
    (probability 1/2, where signed): torchvision's draws after the operation's."""
    table = magnitudes(space, name, bins, size)
    if table is None:
        return name, 0.0
    magnitude = table[pick()]
    if _SPACES[space][name][1] and rnd.uniform() < 0.5:
        magnitude = -magnitude
    return name, magnitude


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_bins(owner: str, bins: int, interpolation: str) -> None:
    # torchvision's Posterize magnitudes divide by bins - 1
    _check(isinstance(bins, int) and bins >= 2, f"{owner}(num_magnitude_bins={bins!r}) needs an integer >= 2")
    _check_interpolation(owner, interpolation)


def _check_interpolation(owner: str, interpolation: str) -> None:
    _check(interpolation in ("nearest", "bilinear"),
           f"{owner} runs with nearest or bilinear interpolation here, got {interpolation!r}")


class _Steps:
    """Shared by the three: a batch's choices applied step by step."""

    interpolation: str

    def apply(self, images: torch.Tensor, choices: Sequence[tuple[Step, ...]]) -> torch.Tensor:
        """(B, 3, S, S) uint8 -> the same with sample i's steps ``choices[i]`` applied in order."""
        for k in range(len(choices[0]) if choices else 0):
            images = apply_operations(images, [c[k] for c in choices], self.interpolation)
        return images


@dataclass(frozen=True)
class TrivialAugment(_Steps):
    """``TrivialAugmentWide(num_magnitude_bins, interpolation)``: one operation per sample, uniform over the
    wide space, then a bin uniform over ``num_bins``, then the sign."""

    num_bins: int = 31
    interpolation: str = "nearest"
    salt: ClassVar[int] = 0x7A1B_0001

    def __post_init__(self) -> None:
        _check_bins("TrivialAugmentWide", self.num_bins, self.interpolation)

    def draw(self, rnd: SampleRandom, size: int) -> tuple[Step]:
        name = _WIDE_NAMES[rnd.randint(0, len(_WIDE_NAMES) - 1)]
        return (_step(rnd, "wide", name, self.num_bins, size, lambda: rnd.randint(0, self.num_bins - 1)),)


@dataclass(frozen=True)
class RandAugment(_Steps):
    """``RandAugment(num_ops, magnitude, num_magnitude_bins, interpolation)``: ``num_ops`` operations per
    sample, each uniform over the standard space (Invert aside), at bin ``magnitude``, then the sign."""

    num_ops: int = 2
    magnitude: int = 9
    num_bins: int = 31
    interpolation: str = "nearest"
    salt: ClassVar[int] = 0x7A1B_0004

    def __post_init__(self) -> None:
        _check_bins("RandAugment", self.num_bins, self.interpolation)
        _check(isinstance(self.magnitude, int) and 0 <= self.magnitude < self.num_bins,
               f"RandAugment(magnitude={self.magnitude!r}) must be a bin in [0, {self.num_bins}) "
               f"(num_magnitude_bins={self.num_bins})")
        _check(isinstance(self.num_ops, int) and self.num_ops >= 0,
               f"RandAugment(num_ops={self.num_ops!r}) needs an integer >= 0")

    def draw(self, rnd: SampleRandom, size: int) -> tuple[Step, ...]:
        return tuple(_step(rnd, "standard", _RAND_NAMES[rnd.randint(0, len(_RAND_NAMES) - 1)], self.num_bins, size,
                           lambda: self.magnitude) for _ in range(self.num_ops))


@dataclass(frozen=True)
class AutoAugment(_Steps):
    """``AutoAugment(policy, interpolation)``: a sub-policy uniform over ``policies`` (pairs of
    (operation, probability, bin of 10 or None)), then for each of its operations whether it runs, then
    the sign."""

    policies: tuple[tuple[tuple[str, float, int | None], ...], ...]
    interpolation: str = "nearest"
    salt: ClassVar[int] = 0x7A1B_0005

    def __post_init__(self) -> None:
        _check_interpolation("AutoAugment", self.interpolation)
        _check(len(self.policies) > 0, "AutoAugment needs at least one sub-policy")
        unknown = sorted({n for sub in self.policies for n, _, _ in sub if n not in STANDARD or n == "Identity"})
        _check(not unknown, f"AutoAugment's policy uses {unknown}, which are not AutoAugment operations")
        bad = [step for sub in self.policies for step in sub
               if not 0 <= step[1] <= 1 or (STANDARD[step[0]][0] is not None and step[2] not in range(10))]
        _check(not bad, f"AutoAugment's policy has steps {bad}: a probability in [0, 1] and a bin in [0, 10) needed")

    def draw(self, rnd: SampleRandom, size: int) -> tuple[Step, ...]:
        policy = self.policies[rnd.randint(0, len(self.policies) - 1)]
        steps = []
        for name, p, index in policy:
            if rnd.uniform() > p:  # torchvision runs it where its draw is <= p
                steps.append(IDENTITY)
            else:
                steps.append(_step(rnd, "standard", name, 10, size, lambda: index))
        return tuple(steps)


class AugMixChoice(NamedTuple):
    """One sample's AugMix: the weights of the original and of each chain (summing to 1), and each chain's
    steps (as many for every chain, Identity after a shorter chain's end)."""

    weights: tuple[float, ...]
    chains: tuple[tuple[Step, ...], ...]


@dataclass(frozen=True)
class AugMix:
    """``AugMix(severity, mixture_width, chain_depth, alpha, all_ops, interpolation)``: the original's
    weight from Beta(alpha, alpha), the chains' from Dirichlet(alpha, ...) times the rest; each chain
    ``chain_depth`` operations long (1 to 3 where it is not positive), each operation uniform over the
    AugMix space (the basic one without ``all_ops``) at a bin uniform below ``severity``, then the sign.
    The mix is cast back to uint8 as torchvision casts it (truncated)."""

    severity: int = 3
    mixture_width: int = 3
    chain_depth: int = -1
    alpha: float = 1.0
    all_ops: bool = True
    interpolation: str = "bilinear"
    salt: ClassVar[int] = 0x7A1B_000A

    def __post_init__(self) -> None:
        _check_interpolation("AugMix", self.interpolation)
        _check(isinstance(self.severity, int) and 1 <= self.severity <= 10,
               f"AugMix(severity={self.severity!r}) needs an integer in [1, 10]")
        _check(isinstance(self.mixture_width, int) and self.mixture_width >= 1,
               f"AugMix(mixture_width={self.mixture_width!r}) needs an integer >= 1")
        _check(isinstance(self.chain_depth, int), f"AugMix(chain_depth={self.chain_depth!r}) needs an integer")
        _check(self.alpha > 0, f"AugMix(alpha={self.alpha!r}) needs a number > 0 (a Dirichlet parameter)")

    @property
    def uniforms(self) -> int:
        """About what a draw takes: some 3 per Gamma draw of the weights (more when one is rejected), up to
        10 per chain."""
        return 3 * (2 + self.mixture_width) + 10 * self.mixture_width

    def draw(self, rnd: SampleRandom, size: int) -> AugMixChoice:
        original, rest = rnd.dirichlet([self.alpha, self.alpha])
        weights = [original] + [w * rest for w in rnd.dirichlet([self.alpha] * self.mixture_width)]
        names = tuple(AUGMIX if self.all_ops else _AUGMIX_BASIC)
        longest = self.chain_depth if self.chain_depth > 0 else 3
        chains = []
        for _ in range(self.mixture_width):
            depth = self.chain_depth if self.chain_depth > 0 else rnd.randint(1, 3)
            chain = tuple(_step(rnd, "augmix", names[rnd.randint(0, len(names) - 1)], 10, size,
                                lambda: rnd.randint(0, self.severity - 1)) for _ in range(depth))
            chains.append(chain + (IDENTITY,) * (longest - depth))
        return AugMixChoice(tuple(weights), tuple(chains))

    def apply(self, images: torch.Tensor, choices: Sequence[AugMixChoice]) -> torch.Tensor:
        """(B, 3, S, S) uint8 -> the same: each sample's weighted sum of itself and its chains' outputs, each
        chain's step k one pass per operation over the batch."""
        weights = on(images.device, [c.weights for c in choices]).view(len(choices), -1, 1, 1, 1)
        mix = images * weights[:, 0]
        for i in range(self.mixture_width):
            chain = images
            for k in range(len(choices[0].chains[i])):
                chain = apply_operations(chain, [c.chains[i][k] for c in choices], self.interpolation)
            mix.add_(weights[:, i + 1] * chain)
        return mix.to(torch.uint8)


def apply_operation(images: torch.Tensor, name: str, magnitude: float, interpolation: str = "nearest") -> torch.Tensor:
    """One operation on (n, 3, S, S) uint8 images through torchvision's functional op, with the arguments
    its auto-augment transforms give it (fill 0)."""
    mode = F.InterpolationMode(interpolation)
    if name == "Identity":
        return images
    if name in ("ShearX", "ShearY"):
        shear = math.degrees(math.atan(magnitude))
        return F.affine(images, angle=0.0, translate=[0, 0], scale=1.0,
                        shear=[shear, 0.0] if name == "ShearX" else [0.0, shear], interpolation=mode, fill=None,
                        center=[0, 0])
    if name in ("TranslateX", "TranslateY"):
        shift = int(magnitude)
        return F.affine(images, angle=0.0, translate=[shift, 0] if name == "TranslateX" else [0, shift], scale=1.0,
                        shear=[0.0, 0.0], interpolation=mode, fill=None)
    if name == "Rotate":
        return F.rotate(images, angle=magnitude, interpolation=mode, fill=None)
    if name in _BLENDS:
        return _BLENDS[name](images, 1.0 + magnitude)
    if name == "Posterize":
        return F.posterize(images, bits=int(magnitude))
    if name == "Solarize":
        return F.solarize(images, threshold=255.0 * magnitude)
    if name == "AutoContrast":
        return F.autocontrast(images)
    if name == "Equalize":
        return F.equalize(images)
    if name == "Invert":
        return F.invert(images)
    raise _unknown(name)


def _unknown(name: str) -> ValueError:
    return ValueError(f"no auto-augment operation {name!r}; the operations are {', '.join(OPERATIONS)}")


_BLENDS = {"Brightness": F.adjust_brightness, "Color": F.adjust_saturation, "Contrast": F.adjust_contrast,
           "Sharpness": F.adjust_sharpness}
_GEOMETRY = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
_NO_MAGNITUDE = {"AutoContrast": pixels.autocontrast, "Equalize": pixels.equalize}


def apply_operations(images: torch.Tensor, steps: Sequence[Step], interpolation: str = "nearest") -> torch.Tensor:
    """(B, 3, S, S) uint8 -> the same with sample i's step ``steps[i]`` applied: through the Triton kernels
    where they run (``kernels.usable``), else ``apply_passes``."""
    if kernels.usable(images) and images.shape[-3] == 3:
        return _through_kernels(images, steps, interpolation)
    return apply_passes(images, steps, interpolation)


def apply_passes(images: torch.Tensor, steps: Sequence[Step], interpolation: str = "nearest") -> torch.Tensor:
    """``apply_operations`` as PyTorch passes on any device: one pass per operation for all the samples that
    drew it, whatever their magnitudes."""

    def run(x: torch.Tensor, key: str, members: list[int]) -> torch.Tensor:
        if key == "blend":
            return pixels.blends(x, [steps[i][0] for i in members], [1.0 + steps[i][1] for i in members])
        if key == "point":
            return pixels.point_ops(x, [steps[i][0] for i in members], [steps[i][1] for i in members])
        return _geometry(x, key, [steps[i] for i in members], interpolation)

    return each_group(images, [_group(name, m) for name, m in steps], run, skip="Identity")


def _through_kernels(images: torch.Tensor, steps: Sequence[Step], interpolation: str) -> torch.Tensor:
    """``apply_operations`` on CUDA: every colour and point operation in one launch of the Triton kernels
    over the batch (``kernels``), then the geometry operations' own passes over their samples. A step is one
    operation, so the two touch different samples."""
    unknown = sorted({name for name, _ in steps if name not in OPERATIONS and name != "Identity"})
    if unknown:
        raise _unknown(unknown[0])
    rows = [kernels.params(name, m) for name, m in steps]
    out = images
    if any(r[0] != kernels.KEEP for r in rows):
        try:
            out = kernels.apply(images, rows)
        except kernels.KernelsFailed:  # a launch failed (said once, and the kernels are off): the PyTorch passes
            return apply_passes(images, steps, interpolation)
    geometry = [_group(name, m) if name in _GEOMETRY else "Identity" for name, m in steps]
    return each_group(out, geometry, lambda x, key, members: _geometry(x, key, [steps[i] for i in members],
                                                                        interpolation), skip="Identity")


def _geometry(images: torch.Tensor, key: str, steps: Sequence[Step], interpolation: str) -> torch.Tensor:
    """One pass of ``apply_operations`` that is not a blend or point pass: every shear, translation and
    rotation of the batch through one grid, or ``_batched``."""
    h, w = images.shape[-2:]
    if key == "affine":
        return pixels.affine(images, [pixels.inverse_matrix(name, m, w, h) for name, m in steps], interpolation)
    return _batched(images, key, [m for _, m in steps], interpolation)


def _group(name: str, magnitude: float) -> str:
    """The pass a step goes through, so that a batch takes a few passes whatever its samples drew: the
    geometry operations share one (rotations by a multiple of 90 degrees apart, which torchvision makes
    exact transposes), the blends with black, grey or the mean share one, Posterize, Solarize and Invert
    share one; Sharpness, AutoContrast and Equalize each their own."""
    if name in _GEOMETRY and BATCHED_GEOMETRY and not (name == "Rotate" and magnitude % 90 == 0):
        return "affine"
    if name in ("Brightness", "Color", "Contrast"):
        return "blend"
    if name in ("Posterize", "Solarize", "Invert"):
        return "point"
    return name


def _batched(images: torch.Tensor, name: str, magnitudes: list[float], interpolation: str) -> torch.Tensor:
    """The passes ``_group`` leaves to one operation. Sharpness, AutoContrast and Equalize, batched; rotations
    by a multiple of 90 degrees (exact transposes in torchvision) and, where torchvision's private helpers are
    missing, every geometry operation: its op per distinct magnitude."""
    if name == "Sharpness":
        return pixels.sharpness(images, [1.0 + m for m in magnitudes])
    if name in _NO_MAGNITUDE:
        return _NO_MAGNITUDE[name](images)
    return each_group(images, magnitudes, lambda x, m, _: apply_operation(x, name, m, interpolation))
