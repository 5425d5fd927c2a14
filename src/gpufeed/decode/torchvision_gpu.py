"""GPU decode through torchvision's ``decode_jpeg(..., device="cuda")`` (nvJPEG), batched.

torchvision fails a whole batch when one image is bad, without saying which, so a failed batch is retried
one image at a time and the failures are reported as not decoded (the CPU decoder takes them).

torchvision's batched CUDA decode runs on the hardware engines, which write when called, not in the stream's
order: into outputs it takes from PyTorch's caching allocator, whose blocks the stream's queued work may still
read (the previous call's copies out of them). So a call first waits on the host for the stream's queued work
(``base.engines_after``), as the other engine decoders do.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import DecodeJob, engines_after


class TorchvisionGpuDecoder:
    """``decode.base.GpuDecoder`` through torchvision."""

    name = "torchvision"
    job_images = 48

    def __init__(self, device: torch.device) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg

        self._decode_jpeg = decode_jpeg
        self._mode = ImageReadMode.RGB
        self.device = device

    def decode(self, job: DecodeJob, stream: torch.cuda.Stream) -> np.ndarray:
        """Decode ``job`` in ``stream``'s order; (n,) bool: which were decoded."""
        inputs = [torch.from_numpy(job.source(j).copy()) for j in range(len(job))]
        engines_after(stream)
        with torch.cuda.stream(stream):
            try:
                chw = self._decode_jpeg(inputs, mode=self._mode, device=self.device)
            except RuntimeError:
                chw = []
                for t in inputs:
                    try:
                        chw.append(self._decode_jpeg(t, mode=self._mode, device=self.device))
                    except RuntimeError:
                        chw.append(None)
            ok = np.zeros(len(job), bool)
            for j, x in enumerate(chw):
                if x is not None and tuple(x.shape) == (3, int(job.heights[j]), int(job.widths[j])):
                    job.target(j).copy_(x.permute(1, 2, 0))
                    ok[j] = True
            return ok
