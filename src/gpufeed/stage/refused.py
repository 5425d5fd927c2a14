"""The GPU stage's samples that no GPU decoder read: decoded on the CPU in the stage's thread, or, where
that fails too under ``on_error="skip"``, dropped from their batch.

The crop follows the loader's recipe (``GpuDecodeAugment``'s ``crop``): "box", training's RandomResizedCrop,
whose box and flip the ring's meta row holds; "center", validation's Resize + CenterCrop, whose resized
extent and crop corner it holds (``records.Meta``). A dropped sample is replaced by another image of its
batch for training (every batch keeps its size: ``decode.base.stand_ins``) and left out for validation,
which counts each image once (the scheduler does the same with what the workers could not load); a
validation batch left empty is not yielded by the loader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..augment.params import CropBox, ResizeCrop
from ..decode.base import DecodeError, SkipLog, stand_ins
from ..decode.crop import decode_box_into, decode_resize_crop_into
from ..records import BOX, Meta

if TYPE_CHECKING:
    from ..decode.cpu import CpuDecoder
    from ..records import HostBatch

CROPS = ("box", "center")


def decode_refused(cpu: "CpuDecoder", batch: "HostBatch", i: int, crop: str) -> None:
    """Sample ``i`` of ``batch``, a plain JPEG the workers left encoded (header read, orientation 1), decoded,
    cropped and resized into its ring pixels ((S, S, 3) uint8) as ``crop`` says. Raises ``DecodeError``."""
    slot = batch.slot
    data = slot.arena[i, : slot.meta[i, Meta.LENGTH]].tobytes()
    size = int(slot.meta[i, Meta.WIDTH]), int(slot.meta[i, Meta.HEIGHT])
    x, y, w, h, flip = (int(v) for v in slot.meta[i, BOX])
    if crop == "center":
        decode_resize_crop_into(cpu, data, batch.path(i), ResizeCrop(w, h, x, y), size, True, slot.images[i])
    else:
        decode_box_into(cpu, data, batch.path(i), CropBox(x, y, w, h, bool(flip)), size, True, slot.images[i])


def settle_dropped(out: torch.Tensor, labels: torch.Tensor, batch: "HostBatch", dropped: list[int], crop: str,
                   skips: SkipLog) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch without the samples at ``dropped`` (recorded in ``skips`` already): for "box" another image
    of the batch copied into each one's place, labels and ``batch.indices`` following; for "center" the
    others moved up in order and the batch cut to them. In place: the batch keeps its memory and format."""
    if crop == "center":
        good = [k for k in range(len(labels)) if k not in set(dropped)]
        for k, g in enumerate(good):
            if k != g:
                out[k].copy_(out[g])
                labels[k] = labels[g]
        batch.indices[:] = [batch.indices[g] for g in good]
        return out[: len(good)], labels[: len(good)]
    subs = stand_ins(len(labels), dropped)
    if not subs:
        raise DecodeError(batch.path(dropped[0]), "no image of its batch could be decoded, so none can stand in "
                          "for it")
    for p, g in subs.items():
        out[p].copy_(out[g])
        labels[p] = labels[g]
        batch.indices[p] = batch.indices[g]
    skips.repeated += len(subs)
    return out, labels
