"""GPU decode through torchvision's ``decode_jpeg(..., device="cuda")`` (nvJPEG), batched.

Used when nvImageCodec is not installed. torchvision fails a whole batch when
one image is bad, without saying which, so a failed batch is retried one image
at a time and the failures come back as None (the CPU decoder takes them).
"""

from __future__ import annotations

from typing import Sequence

import torch


class TorchvisionGpuDecoder:
    name = "torchvision"

    def __init__(self, device: torch.device) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg

        self._decode_jpeg = decode_jpeg
        self._mode = ImageReadMode.RGB
        self.device = device

    def decode(self, datas: Sequence[bytes], stream: torch.cuda.Stream) -> list[torch.Tensor | None]:
        inputs = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
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
            return [None if x is None else x.permute(1, 2, 0) for x in chw]
