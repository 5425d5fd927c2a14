"""Per-sample augmentations run on whole batches on the device, after the crop: TrivialAugmentWide and
RandomErasing, with their random choices drawn per sample as torchvision draws them per image.

Each sample's choices come from its own stream (``params.SampleRandom`` keyed by seed, epoch and index, apart
from the crop's), so a batch is the same whichever worker or rank made it and on every run. Samples that drew
the same operation and magnitude go through torchvision's own functional op together, on the device.

TrivialAugmentWide works on uint8 images in torchvision's recipes (on PIL images, before ``ToTensor``): the
normalised batch is taken back to uint8 pixels for it (rounded, as the PIL pipeline holds its crop) and
normalised again after. RandomErasing follows ``Normalize`` in those recipes and erases the normalised batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torchvision.transforms.v2 import functional as F

from .params import SampleRandom

# Salts for each op's stream of draws, so none repeats the crop's (params.AugmentSpec.draw).
_SALT_TRIVIAL, _SALT_ERASING = 0x7A1B_0001, 0x7A1B_0002

NUM_BINS = 31


def _linspace(a: float, b: float) -> list[float]:
    return torch.linspace(a, b, NUM_BINS).tolist()


# torchvision.transforms.v2.TrivialAugmentWide's space: name -> (magnitudes by bin or None, signed)
TRIVIAL_WIDE: dict[str, tuple[list[float] | None, bool]] = {
    "Identity": (None, False),
    "ShearX": (_linspace(0.0, 0.99), True),
    "ShearY": (_linspace(0.0, 0.99), True),
    "TranslateX": (_linspace(0.0, 32.0), True),
    "TranslateY": (_linspace(0.0, 32.0), True),
    "Rotate": (_linspace(0.0, 135.0), True),
    "Brightness": (_linspace(0.0, 0.99), True),
    "Color": (_linspace(0.0, 0.99), True),
    "Contrast": (_linspace(0.0, 0.99), True),
    "Sharpness": (_linspace(0.0, 0.99), True),
    "Posterize": ((8 - (torch.arange(NUM_BINS) / ((NUM_BINS - 1) / 6))).round().int().tolist(), False),
    "Solarize": (_linspace(1.0, 0.0), False),
    "AutoContrast": (None, False),
    "Equalize": (None, False),
}
_NAMES = tuple(TRIVIAL_WIDE)


def trivial_choice(seed: int, epoch: int, index: int) -> tuple[str, float]:
    """(operation, signed magnitude) for one sample: the operation uniform over the space, then a bin
    uniform over ``NUM_BINS``, then the sign with probability 1/2, as torchvision draws them."""
    rnd = SampleRandom(seed ^ _SALT_TRIVIAL, epoch, index)
    name = _NAMES[rnd.randint(0, len(_NAMES) - 1)]
    magnitudes, signed = TRIVIAL_WIDE[name]
    if magnitudes is None:
        return name, 0.0
    magnitude = float(magnitudes[rnd.randint(0, NUM_BINS - 1)])
    if signed and rnd.uniform() < 0.5:
        magnitude = -magnitude
    return name, magnitude


def apply_trivial(images: torch.Tensor, name: str, magnitude: float) -> torch.Tensor:
    """One TrivialAugmentWide operation on (n, 3, S, S) uint8 images: torchvision's functional op with the
    arguments ``TrivialAugmentWide`` gives it (nearest interpolation, fill 0)."""
    if name == "Identity":
        return images
    if name in ("ShearX", "ShearY"):
        shear = math.degrees(math.atan(magnitude))
        return F.affine(images, angle=0.0, translate=[0, 0], scale=1.0,
                        shear=[shear, 0.0] if name == "ShearX" else [0.0, shear],
                        interpolation=F.InterpolationMode.NEAREST, fill=None, center=[0, 0])
    if name in ("TranslateX", "TranslateY"):
        shift = int(magnitude)
        return F.affine(images, angle=0.0, translate=[shift, 0] if name == "TranslateX" else [0, shift], scale=1.0,
                        shear=[0.0, 0.0], interpolation=F.InterpolationMode.NEAREST, fill=None)
    if name == "Rotate":
        return F.rotate(images, angle=magnitude, interpolation=F.InterpolationMode.NEAREST, fill=None)
    if name == "Brightness":
        return F.adjust_brightness(images, brightness_factor=1.0 + magnitude)
    if name == "Color":
        return F.adjust_saturation(images, saturation_factor=1.0 + magnitude)
    if name == "Contrast":
        return F.adjust_contrast(images, contrast_factor=1.0 + magnitude)
    if name == "Sharpness":
        return F.adjust_sharpness(images, sharpness_factor=1.0 + magnitude)
    if name == "Posterize":
        return F.posterize(images, bits=int(magnitude))
    if name == "Solarize":
        return F.solarize(images, threshold=255.0 * magnitude)
    if name == "AutoContrast":
        return F.autocontrast(images)
    if name == "Equalize":
        return F.equalize(images)
    raise ValueError(f"no TrivialAugmentWide operation {name!r}")


@dataclass(frozen=True)
class Erasing:
    """RandomErasing's settings: probability ``p``, area ``scale``, aspect ``ratio``, fill ``value`` (one
    per channel, in the normalised batch's units, as torchvision erases after Normalize)."""

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: tuple[float, ...] = (0.0,)

    def box(self, size: int, seed: int, epoch: int, index: int) -> tuple[int, int, int, int] | None:
        """(top, left, height, width) to erase in an S x S image, or None: torchvision's draw (probability p,
        then up to 10 tries of area and log-uniform aspect, the position uniform over where it fits)."""
        rnd = SampleRandom(seed ^ _SALT_ERASING, epoch, index)
        if rnd.uniform() >= self.p:
            return None
        area = size * size
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            erase_area = area * rnd.uniform(self.scale[0], self.scale[1])
            aspect = math.exp(rnd.uniform(lo, hi))
            h = int(round(math.sqrt(erase_area * aspect)))
            w = int(round(math.sqrt(erase_area / aspect)))
            if h < size and w < size:
                return rnd.randint(0, size - h), rnd.randint(0, size - w), h, w
        return None


class SampleOps:
    """The per-sample ops of a recipe, applied to a delivered batch: ``trivial`` (TrivialAugmentWide before
    normalising) and ``erasing`` (after). ``mean``/``std``: the batch's normalisation."""

    def __init__(self, *, trivial: bool, erasing: Erasing | None, mean: Sequence[float], std: Sequence[float],
                 seed: int) -> None:
        self.trivial, self.erasing, self.seed = trivial, erasing, seed
        self._mean, self._std = tuple(mean), tuple(std)

    def __bool__(self) -> bool:
        return self.trivial or self.erasing is not None

    def __call__(self, images: torch.Tensor, indices: Sequence[int], epoch: int) -> torch.Tensor:
        """(B, 3, S, S) normalised images (any float dtype and memory format) -> the same with each sample's
        ops applied; ``indices[i]``: sample i's source index."""
        out = images
        if self.trivial:
            out = self._trivial(out, indices, epoch)
        if self.erasing is not None:
            out = self._erase(out, indices, epoch)
        return out

    def _constants(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self._mean, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self._std, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
        return mean, std

    def _trivial(self, images: torch.Tensor, indices: Sequence[int], epoch: int) -> torch.Tensor:
        mean, std = self._constants(images)
        pixels = (images.float() * std + mean).mul_(255).round_().clamp_(0, 255).to(torch.uint8)
        groups: dict[tuple[str, float], list[int]] = {}
        for i, index in enumerate(indices):
            groups.setdefault(trivial_choice(self.seed, epoch, index), []).append(i)
        for (name, magnitude), members in groups.items():
            if name == "Identity":
                continue
            rows = torch.tensor(members, device=images.device)
            pixels[rows] = apply_trivial(pixels[rows], name, magnitude)
        out = (pixels.float().div_(255) - mean) / std
        channels_last = images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
        return out.to(dtype=images.dtype,
                      memory_format=torch.channels_last if channels_last else torch.contiguous_format)

    def _erase(self, images: torch.Tensor, indices: Sequence[int], epoch: int) -> torch.Tensor:
        size = images.shape[-1]
        value = torch.tensor(self.erasing.value, dtype=images.dtype, device=images.device).view(-1, 1, 1)
        for i, index in enumerate(indices):
            box = self.erasing.box(size, self.seed, epoch, index)
            if box is not None:
                top, left, h, w = box
                images[i, :, top : top + h, left : left + w] = value
        return images
