"""The device-side stage: a host batch in, the delivered batch out, on the loader's side stream.

    HostBatch ──► gpu.GpuStage (GPU path): decode on the GPU's engines, one fused crop/resize/flip/normalise
             │                            kernel (uint8 crops where the recipe has pixel ops); validation's
             │                            Resize + CenterCrop in Pillow's arithmetic (``augment.center_crop``)
             └──► host.HostStage (CPU decode): normalise the workers' uint8 crops on the device, or copy out
                                              the batch a CPU device's workers normalised
          ──► per_sample.PerSample: the recipe's per-sample ops, then MixUp/CutMix ──► records.Delivered

One of the two is chosen when the loader is made (``create_stage``): the GPU path where a GPU decoder was
made (``placement.create_gpu_decoders``), the host stage otherwise. Both take a batch as the Prefetcher
hands it (a call, or ``start``/``finish`` one batch apart where the GPU decodes the next batch meanwhile),
say whether the Prefetcher hands the ring slot back (``issued``) and which stream reads what they deliver
(``read_on``, once an iteration).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .gpu import GpuDecodeAugment, GpuStage
from .host import HostStage
from .per_sample import PerSample

if TYPE_CHECKING:
    from ..augment.normalize import Normalize
    from ..decode.base import GpuDecoder, SkipLog
    from ..placement import GpuMemory

__all__ = ["GpuDecodeAugment", "GpuStage", "HostStage", "PerSample", "create_stage"]


def create_stage(gpu_decoders: "Sequence[GpuDecoder] | None", per_sample: PerSample, *, device: torch.device,
                 image_size: int, normalize: "Normalize", max_pixels: int, memory: "GpuMemory", batch_size: int,
                 skips: "SkipLog | None", crop: str = "box") -> "GpuStage | HostStage":
    """The GPU path's stage where there are GPU decoders, else the host stage. ``memory``: the loader's GPU
    budget (``placement.gpu_memory``), whose buffers and output batches the GPU stage takes now; ``skips``:
    where a file no decoder reads is recorded (None: it raises); ``crop``: "box" (training's crop boxes) or
    "center" (validation's Resize + CenterCrop), as ``GpuDecodeAugment`` takes it."""
    if gpu_decoders is None:
        return HostStage(normalize, per_sample)
    pixels = bool(per_sample.ops.pixel)  # pixel ops start from the crops' uint8 pixels (PerSample)
    decode = GpuDecodeAugment(gpu_decoders, device=device, image_size=image_size, mean=normalize.mean,
                              std=normalize.std, dtype=torch.uint8 if pixels else normalize.dtype,
                              channels_last=normalize.channels_last, max_pixels=max_pixels,
                              buffer_bytes=memory.buffer_bytes, skips=skips,
                              output_batches=(batch_size, memory.batches), crop=crop)
    return GpuStage(decode, per_sample)
