"""The records that pass between the stages: a GPU-path position's metadata in the ring, the fused crop
kernel's table row, the host batch the scheduler hands on and the batch the device-side stage delivers.
Imports numpy alone, so the worker processes read it without PyTorch.

    workers ──Meta rows in the ring──► scheduler ──HostBatch──► device-side stage ──Delivered──► loader
                                                                (KernelRow: one per sample, to the kernel)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

if TYPE_CHECKING:
    import torch


class Meta(IntEnum):
    """Columns of a GPU-path position's metadata row (``Ring.meta[slot, k]``, int64): what it holds
    (``KIND``), its byte count, the extent of the image those bytes are, and the crop box within it (for
    validation's Resize + CenterCrop, in the box's five columns: the crop's left and top in the resized
    image, the resized width and height, 0)."""

    KIND = 0
    LENGTH = 1
    WIDTH = 2
    HEIGHT = 3
    BOX_X = 4
    BOX_Y = 5
    BOX_W = 6
    BOX_H = 7
    FLIP = 8


# the box columns, in the fused kernel's order: x, y, width, height, flip
BOX = slice(Meta.BOX_X, Meta.FLIP + 1)
# What a GPU-path position holds: KIND_PIXELS, the finished (S, S, 3) crop in ``images``; KIND_BYTES, the JPEG
# in ``arena`` (length bytes, a width x height image) and its crop box; KIND_ROWS, decoded RGB rows in
# ``rooms`` (length bytes: height rows of width pixels) and the crop box within them, for the GPU to resize.
KIND_PIXELS, KIND_BYTES, KIND_ROWS = 0, 1, 2


class KernelRow(IntEnum):
    """Columns of the fused crop kernel's table (one int64 row per sample, ``augment.fused``): where the
    sample's decoded pixels start in the flat buffer, their extent, the crop box and the flip (validation's
    kernel, ``augment.center_crop``: the crop's left and top, the resized width and height, 0)."""

    OFFSET = 0
    HEIGHT = 1
    WIDTH = 2
    BOX_X = 3
    BOX_Y = 4
    BOX_W = 5
    BOX_H = 6
    FLIP = 7


@dataclass
class HostBatch:
    """One finished batch in a ring slot, as the device-side stage receives it (host side).

    S: the size the batch was made at (``slot.size``).
    labels: (n,) int64 CPU tensor, copied out of the slot. images: (n, S, S, 3) uint8 CPU tensor viewing the
    slot (CPU decode), for a CPU device the slot's normalised float32 output ((n, S, S, 3) or (n, 3, S, S),
    ``ring.Ring``), or None on the GPU path, where ``slot`` holds each sample's bytes or rows and crop
    box (``ring.Meta``). ``indices[i]``: the source index of sample i (a stand-in's where a sample was
    skipped); ``consumed``: entries of the epoch's order this batch took; ``path(i)`` names sample i's
    file. ``release()`` hands the slot back once nothing will read it any more (on CUDA: once the work
    queued so far on the current stream has run).
    """

    labels: "torch.Tensor"
    slot: Any  # the slot's views (ring.SlotView)
    indices: list[int]
    consumed: int
    release: Callable[[], None]
    path: Callable[[int], str]
    images: "torch.Tensor | None" = None
    seed: int = 0  # the order's seed and epoch, which the batch's crops and per-sample ops are drawn for
    epoch: int = 0


class Delivered(NamedTuple):
    """A batch on the device, with its samples' source indices and the entries of the epoch's order it took
    (for the sampler's position)."""

    images: "torch.Tensor"
    labels: "torch.Tensor"
    indices: list[int]
    consumed: int
