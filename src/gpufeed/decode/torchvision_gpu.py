"""GPU decode through torchvision's ``decode_jpeg(..., device="cuda")`` (nvJPEG), batched.

Used when nvImageCodec is not installed. torchvision fails a whole batch when
one image is bad, without saying which, so a failed batch is retried one image
at a time and the failures are reported as not decoded (the CPU decoder takes them).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class TorchvisionGpuDecoder:
    name = "torchvision"

    def __init__(self, device: torch.device) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg

        self._decode_jpeg = decode_jpeg
        self._mode = ImageReadMode.RGB
        self.device = device

    def decode_into(self, datas: Sequence[np.ndarray], outs: Sequence[torch.Tensor],
                    stream: torch.cuda.Stream) -> list[bool]:
        """Decode ``datas`` (uint8 arrays) into ``outs`` ((h, w, 3) uint8 CUDA tensors of each image's size)
        in ``stream``'s order; returns which images were decoded."""
        inputs = [torch.from_numpy(np.array(d, dtype=np.uint8, copy=True)) for d in datas]
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
            ok = []
            for x, out in zip(chw, outs):
                good = x is not None and tuple(x.shape) == (3, *out.shape[:2])
                if good:
                    out.copy_(x.permute(1, 2, 0))
                ok.append(good)
            return ok
