"""Per-sample augmentations run on whole batches on the device, after the crop, in the order the recipe gives
them, with their random choices drawn per sample as torchvision draws them per image.

Each op draws each sample's choices from its own stream (``params.SampleRandom`` keyed by seed, epoch and
index, and salted by the op, apart from the crop's), so a batch is the same whichever worker or rank made it
and on every run. The samples that drew the same thing go through it together, on the batch's device, each
with its own magnitude (``pixels``).

The pixel ops (``basic``: ColorJitter, RandomGrayscale, GaussianBlur, RandomAdjustSharpness,
RandomVerticalFlip; ``auto``: TrivialAugmentWide, RandAugment, AutoAugment, AugMix; ``perspective``:
RandomPerspective; ``containers``: RandomApply, RandomChoice, RandomOrder of them) work on uint8 images in
torchvision's recipes (on PIL images, before ``ToTensor``): the loader hands them the uint8 crops (from the
GPU stage or the workers, ``from_pixels``); a normalised batch given to ``__call__`` is first taken back to
uint8 pixels once for all of them (rounded, as the PIL pipeline holds its crop). The result is normalised
as ``Normalize`` normalises.
RandomErasing (``erasing``) follows ``Normalize`` in those recipes and erases the normalised batch.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from ..fused import normalize_constants
from ..params import SampleRandom
from .auto import (AugMix, AugMixChoice, AutoAugment, RandAugment, TrivialAugment, apply_operation,
                   apply_operations, apply_passes)
from .basic import Blur, Grayscale, Jitter, JitterChoice, Sharpen, VerticalFlip
from .containers import Apply, Choice, Order, container_salt, each_op
from .erasing import Erasing
from . import kernels
from .perspective import Perspective
from .pixels import DrawFailed, on

__all__ = ["Apply", "AugMix", "AugMixChoice", "AutoAugment", "Blur", "Choice", "Erasing", "Grayscale", "Jitter",
           "JitterChoice", "Order", "Perspective", "PixelOp", "RandAugment", "SampleOps", "Sharpen", "TrivialAugment",
           "VerticalFlip", "apply_operation", "apply_operations", "apply_passes", "container_salt", "each_op"]


class PixelOp(Protocol):
    """One per-sample op: ``draw`` gives one sample's choice from its stream (for S x S images), ``apply``
    gives a batch with each sample's choice applied (a new tensor; the one given is left as it is)."""

    salt: int  # apart from every other op's stream (and the crop's); a class constant but for the containers
    # (optional) how many uniforms one sample's draw usually takes, computed ahead for a batch at once
    # (``SampleRandom.streams``' default where it is missing); draws that take more go on one at a time

    def draw(self, rnd: SampleRandom, size: int) -> Any: ...

    def apply(self, images: torch.Tensor, choices: Sequence[Any]) -> torch.Tensor: ...


class SampleOps:
    """The per-sample ops of a recipe, applied to a delivered batch: ``pixel`` (uint8 ops, in order, before
    normalising) and ``erasing`` (after). ``mean``/``std``: the batch's normalisation; ``names``: the
    recipe's ops these are, as torchvision names them (``loader.stats["ops_on_device"]``). Returns a new tensor;
    the batch given is left as it is."""

    def __init__(self, *, pixel: Sequence[PixelOp] = (), erasing: Erasing | None = None, mean: Sequence[float],
                 std: Sequence[float], names: Sequence[str] = ()) -> None:
        self.pixel, self.erasing, self.names = tuple(pixel), erasing, tuple(names)
        self._mean, self._std = tuple(mean), tuple(std)
        self._constants: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self.pixel) or self.erasing is not None

    def auto_augment_runner(self, device: torch.device) -> str | None:
        """What runs the auto-augment family's colour and point operations on ``device`` (``kernels.describe``),
        or None on a CPU device or without those ops."""
        if device.type != "cuda" or not any(isinstance(op, (AugMix, AutoAugment, RandAugment, TrivialAugment))
                                            for op in each_op(self.pixel)):
            return None
        return kernels.describe()

    def check_size(self, size: int) -> None:
        """ValueError, naming the op, unless every op, a container's too, can work on S x S images (GaussianBlur's
        padding)."""
        for op in each_op(self.pixel):
            check = getattr(op, "check_size", None)
            if check is not None:
                check(size)

    @staticmethod
    def draws(op: PixelOp | Erasing, indices: Sequence[int], seed: int, epoch: int, size: int) -> list[Any]:
        """``op``'s choice for each sample of ``indices`` in the loader's ``seed`` and ``epoch``."""
        streams = SampleRandom.streams(seed ^ op.salt, epoch, indices, getattr(op, "uniforms", None))
        return [op.draw(rnd, size) for rnd in streams]

    def __call__(self, images: torch.Tensor, indices: Sequence[int], seed: int, epoch: int) -> torch.Tensor:
        """(B, 3, S, S) normalised images (any float dtype and memory format, any device) -> a new batch with
        each sample's ops applied; ``indices[i]``: sample i's source index, in the loader's ``seed`` and
        ``epoch``."""
        out = images
        if self.pixel:  # back to the crop's uint8 pixels (rounded, as the PIL pipeline holds its crop)
            mean, std, _, _ = self._device_constants(images.device)
            pixels = (images.float() * std + mean).mul_(255).round_().clamp_(0, 255).to(torch.uint8)
            channels_last = images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
            out = self._pixels(pixels, indices, seed, epoch, images.dtype, channels_last)
        return self._erased(out, indices, seed, epoch)

    def from_pixels(self, pixels: torch.Tensor, indices: Sequence[int], seed: int, epoch: int, *,
                    dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
        """(B, 3, S, S) uint8 crops, before normalising (any strides) -> the batch ``__call__`` gives for
        them once normalised, in ``dtype`` and the asked layout, without normalising first and going back
        (the loader's batches with pixel ops: the GPU stage and the workers hand over uint8). The same bits
        where the round trip gives every level back (ImageNet's constants, in float32, bfloat16 and float16); where it does
        not (bfloat16 with some other constants), these are the crop's own pixels."""
        out = self._pixels(pixels.contiguous(), indices, seed, epoch, dtype, channels_last)
        return self._erased(out, indices, seed, epoch)

    def _erased(self, images: torch.Tensor, indices: Sequence[int], seed: int, epoch: int) -> torch.Tensor:
        if self.erasing is None:
            return images
        return self.erasing.apply(images, self.draws(self.erasing, indices, seed, epoch, images.shape[-1]))

    def _device_constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(mean, std, scale, shift), each (1, 3, 1, 1) float32 on ``device``: uint8 v normalises to
        v x scale + shift, as ``Normalize`` computes it."""
        if device not in self._constants:  # once per device, not a copy per batch
            scale, shift = normalize_constants(self._mean, self._std)
            self._constants[device] = tuple(on(device, v).view(1, 3, 1, 1) for v in (self._mean, self._std, scale, shift))
        return self._constants[device]

    def _pixels(self, pixels: torch.Tensor, indices: Sequence[int], seed: int, epoch: int, dtype: torch.dtype,
                channels_last: bool) -> torch.Tensor:
        """(B, 3, S, S) uint8 through every pixel op in the recipe's order, then normalised into a new batch of
        ``dtype``: in one Triton kernel where it runs (``kernels.normalize``), else PyTorch passes, the same bits."""
        _, _, scale, shift = self._device_constants(pixels.device)
        for op in self.pixel:
            draws = self.draws(op, indices, seed, epoch, pixels.shape[-1])
            try:
                pixels = op.apply(pixels, draws)
            except DrawFailed as failed:  # name the sample, so that it can be drawn again
                index = next((i for i, d in zip(indices, draws) if _holds(d, failed.draw)), "?")
                raise ValueError(f"sample {index} of epoch {epoch} (seed {seed}): {failed}") from failed
        if kernels.usable(pixels) and kernels.normalizes(pixels, dtype):  # one pass, the same bits
            try:
                return kernels.normalize(pixels, scale, shift, dtype, channels_last)
            except kernels.KernelsFailed:  # said once, and the kernels are off: the PyTorch passes
                pass
        out = (pixels * scale).add_(shift)  # float32: the cast in the product, two passes over the batch
        return out.to(dtype=dtype, memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _holds(choice: Any, draw: Any) -> bool:
    """Whether ``choice`` (one sample's draw of an op, a container's holding its ops' draws) is or holds ``draw``."""
    return choice == draw or (isinstance(choice, tuple) and any(_holds(c, draw) for c in choice))
