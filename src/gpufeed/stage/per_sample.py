"""The recipe's per-sample ops and its MixUp or CutMix, on a batch the stage has made."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..augment.mix import BatchMix
    from ..augment.normalize import Normalize
    from ..augment.ops import SampleOps
    from ..records import HostBatch


class PerSample:
    """The recipe's per-sample ops (TrivialAugmentWide, ColorJitter, RandomErasing, ...), then its MixUp or
    CutMix (``mix``, set by ``ImageLoader.batch_transform``), on a finished batch, drawn for the seed and epoch
    its order was made for (as its crops were; the mix keyed by the batch's first sample). On CUDA this runs in
    the Prefetcher's thread on its side stream, so the kernels overlap the training and their Python stays off
    the training thread."""

    def __init__(self, ops: "SampleOps", normalize: "Normalize", mix: "BatchMix | None" = None) -> None:
        self.ops, self.normalize, self.mix = ops, normalize, mix

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 batch: "HostBatch") -> tuple[torch.Tensor, torch.Tensor]:
        """``images``: (B, 3, S, S) normalised, or, where the recipe has pixel ops, the crops' uint8 pixels
        (any strides), which those ops start from (``SampleOps.from_pixels``: no normalising and back)."""
        fresh = images.dtype == torch.uint8 or bool(self.ops)  # the ops make a new batch: MixUp may too
        if images.dtype == torch.uint8:
            images = self.ops.from_pixels(images, batch.indices, batch.seed, batch.epoch, dtype=self.normalize.dtype,
                                          channels_last=self.normalize.channels_last)
        elif self.ops:
            images = self.ops(images, batch.indices, batch.seed, batch.epoch)
        if self.mix is not None:
            images, labels = self.mix(images, labels, batch.seed, batch.epoch, batch.indices[0], fresh=fresh)
        return images, labels
