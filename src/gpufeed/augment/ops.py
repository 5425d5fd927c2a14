"""Per-sample augmentations run on whole batches on the device, after the crop: TrivialAugmentWide and
RandomErasing, with their random choices drawn per sample as torchvision draws them per image.

Each sample's choices come from its own stream (``params.SampleRandom`` keyed by seed, epoch and index, apart
from the crop's), so a batch is the same whichever worker or rank made it and on every run. Samples that drew
the same operation go through it together, on the device, each with its own magnitude, computed as
torchvision's functional op computes it (``apply_trivial_batch``: the same pixels, or within one level for
the blends).

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


try:  # torchvision's own pieces, so a whole group's affine and grey levels are computed as its ops compute them
    from torchvision.transforms.v2.functional._color import _rgb_to_grayscale_image
    from torchvision.transforms.v2.functional._geometry import _get_inverse_affine_matrix
except ImportError:  # another torchvision: every sample through the public ops instead (the same pixels, slower)
    _get_inverse_affine_matrix = _rgb_to_grayscale_image = None


def _on(device: torch.device, values, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values`` as a tensor on ``device``: through page-locked memory without waiting on CUDA, since a copy
    from ordinary memory would first wait for all the work queued on the stream (the training's)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def apply_trivial_batch(images: torch.Tensor, choices: Sequence[tuple[str, float]]) -> torch.Tensor:
    """(B, 3, S, S) uint8 -> the same with sample i's TrivialAugmentWide choice ``choices[i]`` applied: one pass
    per operation for all the samples that drew it, whatever their magnitudes (``apply_trivial`` per
    magnitude where this torchvision's helpers are missing, and for rotations by a multiple of 90 degrees,
    which torchvision turns into exact transposes)."""
    out = images.clone()
    by_op: dict[str, list[int]] = {}
    for i, (name, _) in enumerate(choices):
        by_op.setdefault(name, []).append(i)
    for name, members in by_op.items():
        if name == "Identity":
            continue
        rows = _on(images.device, members, torch.int64)
        magnitudes = [choices[i][1] for i in members]
        out[rows] = _one_op(images[rows], name, magnitudes)
    return out


def _one_op(images: torch.Tensor, name: str, magnitudes: list[float]) -> torch.Tensor:
    n, _, h, w = images.shape
    if name == "Rotate" and _get_inverse_affine_matrix is not None:
        # torchvision turns rotations by a multiple of 90 degrees into exact transposes: those samples alone
        square = [i for i, m in enumerate(magnitudes) if m % 90 == 0]
        if square and len(square) < n:
            rest = [i for i in range(n) if i not in set(square)]
            out = images.clone()
            for part in (square, rest):
                rows = _on(images.device, part, torch.int64)
                out[rows] = _one_op(images[rows], name, [magnitudes[i] for i in part])
            return out
    if _get_inverse_affine_matrix is None or name in ("Posterize", "AutoContrast", "Equalize") or (
            name == "Rotate" and all(m % 90 == 0 for m in magnitudes)):
        out = images.clone()
        for m in sorted(set(magnitudes)):  # one call per distinct magnitude, through the public op
            rows = _on(images.device, [i for i, x in enumerate(magnitudes) if x == m], torch.int64)
            out[rows] = apply_trivial(images[rows], name, m)
        return out
    f = _on(images.device, magnitudes).view(n, 1, 1, 1)
    if name in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"):
        return _affine(images, [_matrix(name, m, w, h) for m in magnitudes])
    if name == "Solarize":
        return torch.where(images >= 255.0 * f, 255 - images, images)
    ratio = 1.0 + f
    if name == "Brightness":
        return images.mul(ratio).clamp_(0, 255).to(torch.uint8)
    if name in ("Color", "Contrast"):
        grey = _rgb_to_grayscale_image(images, num_output_channels=1, preserve_dtype=False).floor_()
        if name == "Contrast":
            grey = grey.mean(dim=(-3, -2, -1), keepdim=True)
        return images.mul(ratio).add_(grey * (1.0 - ratio)).clamp_(0, 255).to(torch.uint8)
    if name == "Sharpness":
        a, b = 1.0 / 13.0, 5.0 / 13.0
        kernel = _on(images.device, [[a, a, a], [a, b, a], [a, a, a]]).expand(3, 1, 3, 3)
        out = images.to(torch.float32, copy=True)
        blurred = torch.nn.functional.conv2d(out, kernel, groups=3).round_()
        inner = out[..., 1:-1, 1:-1]
        inner.add_(blurred.sub_(inner) * (1.0 - ratio))
        return out.clamp_(0, 255).to(torch.uint8)
    raise ValueError(f"no TrivialAugmentWide operation {name!r}")


def _matrix(name: str, magnitude: float, w: int, h: int) -> list[float]:
    """The inverse affine matrix torchvision's ``affine``/``rotate`` build for this operation."""
    if name in ("ShearX", "ShearY"):
        shear = math.degrees(math.atan(magnitude))
        return _get_inverse_affine_matrix([-w * 0.5, -h * 0.5], 0.0, [0.0, 0.0], 1.0,
                                          [shear, 0.0] if name == "ShearX" else [0.0, shear])
    if name in ("TranslateX", "TranslateY"):
        shift = float(int(magnitude))
        return _get_inverse_affine_matrix([0.0, 0.0], 0.0, [shift, 0.0] if name == "TranslateX" else [0.0, shift],
                                          1.0, [0.0, 0.0])
    return _get_inverse_affine_matrix([0.0, 0.0], -(magnitude % 360), [0.0, 0.0], 1.0, [0.0, 0.0])  # Rotate


def _affine(images: torch.Tensor, matrices: list[list[float]]) -> torch.Tensor:
    """Each image through its own inverse affine matrix: torchvision's grid (``_affine_grid``) per sample in
    one batched product, then one nearest-neighbour ``grid_sample`` with zeros outside."""
    n, _, h, w = images.shape
    device = images.device
    theta = _on(device, matrices).view(n, 2, 3)
    base = torch.empty(1, h, w, 3, dtype=torch.float32, device=device)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=device))
    base[..., 1].copy_(torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=device).unsqueeze_(-1))
    base[..., 2].fill_(1)
    rescaled = theta.transpose(1, 2).div_(_on(device, [0.5 * w, 0.5 * h]))
    grid = base.view(1, h * w, 3).expand(n, -1, -1).bmm(rescaled).view(n, h, w, 2)
    out = torch.nn.functional.grid_sample(images.float(), grid, mode="nearest", padding_mode="zeros",
                                          align_corners=False)
    return out.round_().to(torch.uint8)


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
    normalising) and ``erasing`` (after). ``mean``/``std``: the batch's normalisation. Returns a new tensor;
    the batch given is left as it is."""

    def __init__(self, *, trivial: bool, erasing: Erasing | None, mean: Sequence[float], std: Sequence[float]) -> None:
        self.trivial, self.erasing = trivial, erasing
        self._mean, self._std = tuple(mean), tuple(std)
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    def __bool__(self) -> bool:
        return self.trivial or self.erasing is not None

    def __call__(self, images: torch.Tensor, indices: Sequence[int], seed: int, epoch: int) -> torch.Tensor:
        """(B, 3, S, S) normalised images (any float dtype and memory format) -> a new batch with each
        sample's ops applied; ``indices[i]``: sample i's source index, in the loader's ``seed`` and ``epoch``."""
        out = images
        if self.trivial:
            out = self._trivial(out, indices, seed, epoch)
        if self.erasing is not None:
            out = self._erase(out, indices, seed, epoch)
        return out

    def _device_constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if device not in self._constants:  # once per device, not a copy per batch
            value = None if self.erasing is None else _on(device, self.erasing.value).view(1, -1, 1, 1)
            self._constants[device] = (_on(device, self._mean).view(1, 3, 1, 1),
                                       _on(device, self._std).view(1, 3, 1, 1), value)
        return self._constants[device]

    def _trivial(self, images: torch.Tensor, indices: Sequence[int], seed: int, epoch: int) -> torch.Tensor:
        mean, std, _ = self._device_constants(images.device)
        pixels = (images.float() * std + mean).mul_(255).round_().clamp_(0, 255).to(torch.uint8)
        pixels = apply_trivial_batch(pixels, [trivial_choice(seed, epoch, index) for index in indices])
        out = (pixels.float().div_(255) - mean) / std
        channels_last = images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
        return out.to(dtype=images.dtype,
                      memory_format=torch.channels_last if channels_last else torch.contiguous_format)

    def _erase(self, images: torch.Tensor, indices: Sequence[int], seed: int, epoch: int) -> torch.Tensor:
        """One masked pass: each sample's box (top, left, height, width; an empty one where it drew none)."""
        size = images.shape[-1]
        boxes = [self.erasing.box(size, seed, epoch, index) or (0, 0, 0, 0) for index in indices]
        b = _on(images.device, boxes, torch.int64).view(-1, 4, 1, 1)
        at = torch.arange(size, device=images.device)
        rows = (at.view(1, size, 1) >= b[:, 0]) & (at.view(1, size, 1) < b[:, 0] + b[:, 2])
        cols = (at.view(1, 1, size) >= b[:, 1]) & (at.view(1, 1, size) < b[:, 1] + b[:, 3])
        _, _, value = self._device_constants(images.device)
        return torch.where((rows & cols).unsqueeze(1), value.to(images.dtype), images)
