"""The device-side stage for batches the CPU workers decoded (CPU decode, to CUDA or to a CPU device)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..records import Delivered

if TYPE_CHECKING:
    from ..augment.normalize import Normalize
    from ..records import HostBatch
    from .per_sample import PerSample


class HostStage:
    """HostBatch -> Delivered: the (B, S, S, 3) uint8 crops normalised on the device (CUDA), or the batch the
    workers normalised, copied out of the ring (a CPU device); then the per-sample ops. Where the recipe has
    pixel ops the batch stays uint8 and they start from it. The ring slot goes back once the batch's copies
    are queued (``issued``: on CUDA the slot's event is recorded on the copies' stream)."""

    name = "cpu"

    def __init__(self, normalize: "Normalize", per_sample: "PerSample") -> None:
        self.normalize, self.per_sample = normalize, per_sample
        self.decoded_by: dict[str, int] = {}  # the workers decode everything: counted by no GPU decoder

    def __call__(self, batch: "HostBatch") -> Delivered:
        images = batch.images
        if images.dtype == torch.float32:  # a CPU device's workers normalised it
            images = self.normalize.finished(images)
        elif self.per_sample.ops.pixel:  # (B, S, S, 3) uint8 crops, taken as they are
            images = images.permute(0, 3, 1, 2)
        else:
            images = self.normalize.images(images)
        return Delivered(*self.per_sample(images, batch.labels, batch), batch.indices, batch.consumed)

    @staticmethod
    def issued(batch: "HostBatch") -> None:
        batch.release()

    def read_on(self, stream: "torch.cuda.Stream | None") -> None:
        """Nothing the stage holds is read on the training's stream."""
