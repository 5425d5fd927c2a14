"""GPU decode through nvImageCodec: the NVJPG hardware engines first, nvJPEG's CUDA decoder after.

``decode`` reads the encoded bytes in place (views of the shared ring, not copied) and decodes each image
straight into its place in the caller's device buffer, saying which ones failed (the caller sends those to
the CPU decoder). Work is queued on the caller's CUDA stream.

The 0.9 spelling is ``Decoder(backends=[Backend(BackendKind.HW_GPU_ONLY, load_hint=...)])``. With
``load_hint=1.0`` on the hardware backend every image the engines accept goes there; what they refuse
(progressive, 4:4:4 on some chips, CMYK...) falls through to the hybrid CUDA backend.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import DecodeJob, engines_after


def load_nvimgcodec():
    """The nvimgcodec module, or None (with the reason) when it cannot be imported."""
    try:
        from nvidia import nvimgcodec
    except ImportError as e:
        return None, f"not installed ({e})"
    return nvimgcodec, ""


class NvImageCodecDecoder:
    """Batched GPU decode (``decode.base.GpuDecoder``); created once per loader on one device."""

    name = "nvimgcodec"
    job_images = 48  # calls of about this many, taken in turn by the decoder threads (one's host work overlaps another's decode)

    def __init__(self, device: torch.device, *, hw_load: float = 1.0, cpu_threads: int = 2) -> None:
        nvimgcodec, why = load_nvimgcodec()
        if nvimgcodec is None:
            raise RuntimeError(f"nvImageCodec {why}")
        self._nv = nvimgcodec
        kinds = nvimgcodec.BackendKind
        # what the engines refuse goes to nvJPEG's CUDA decoder
        backends = [nvimgcodec.Backend(kinds.HW_GPU_ONLY, load_hint=hw_load), nvimgcodec.Backend(kinds.HYBRID_CPU_GPU)]
        self.device = device
        # fancy_upsampling=1: the same chroma upsampling as libjpeg-turbo's default (the CPU path),
        # where nvImageCodec's default of 0 differs visibly on 4:2:0 edges.
        self._decoder = nvimgcodec.Decoder(device_id=device.index or 0, max_num_cpu_threads=cpu_threads,
                                           backends=backends, options=":fancy_upsampling=1")
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                               allow_any_depth=False, sample_format=nvimgcodec.SampleFormat.I_RGB)
        self.in_place = True  # decodes into the caller's buffers (nvImageCodec >= 0.9); else decode, then copy

    def decode(self, job: DecodeJob, stream: torch.cuda.Stream) -> np.ndarray:
        """Decode ``job`` in ``stream``'s order; (n,) bool: which were decoded."""
        nv, cuda_stream = self._nv, stream.cuda_stream
        codes, where = [], []
        for i in range(len(job)):
            try:
                codes.append(nv.CodeStream(job.source(i)))
                where.append(i)
            except Exception:  # unparseable for nvImageCodec: the CPU decoder decides
                pass
        ok = np.zeros(len(job), bool)
        if not codes:
            return ok
        if self.in_place:
            engines_after(stream)  # nvImageCodec's engine decode writes at the call, not in the stream's order
            try:
                targets = [nv.as_image(job.device_view(i), cuda_stream) for i in where]
                images = self._decode(codes, targets, cuda_stream)
            except (RuntimeError, TypeError, ValueError):
                self.in_place = False  # this version cannot decode into given buffers: decode, then copy
        if not self.in_place:
            images = self._decode(codes, None, cuda_stream)
        with torch.cuda.stream(stream):
            for i, img in zip(where, images):
                if img is None or tuple(img.shape) != (int(job.heights[i]), int(job.widths[i]), 3):
                    continue
                if not self.in_place:
                    job.target(i).copy_(torch.as_tensor(img, device=self.device))
                ok[i] = True
        return ok

    def _decode(self, codes: list, targets: list | None, cuda_stream: int) -> list:
        images = self._decoder.decode(codes, images=targets, params=self._params, cuda_stream=cuda_stream)
        if len(images) != len(codes):
            # Some nvImageCodec versions drop failed entries instead of returning None, which would
            # shift every later image onto the wrong sample: decode one at a time to know which failed.
            images = [self._decoder.decode(cs, image=None if targets is None else targets[k], params=self._params,
                                           cuda_stream=cuda_stream) for k, cs in enumerate(codes)]
        return images
