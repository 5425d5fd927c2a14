"""GPU decode through nvImageCodec: the NVJPG hardware engines first, nvJPEG's CUDA decoder after.

``decode`` takes encoded bytes and returns one (h, w, 3) uint8 CUDA tensor per
image, or None where nvImageCodec could not decode it (the caller sends those
to the CPU decoder). Work is queued on the caller's CUDA stream.

The 0.9 spelling is ``Decoder(backends=[Backend(BackendKind.HW_GPU_ONLY, load_hint=...)])``.
With ``load_hint=1.0`` on the hardware backend every image the engines accept goes
there; what they refuse (progressive, 4:4:4 on some chips, CMYK...) falls through to
the hybrid CUDA backend.
"""

from __future__ import annotations

from typing import Sequence

import torch


def load_nvimgcodec():
    """The nvimgcodec module, or None (with the reason) when it cannot be imported."""
    try:
        from nvidia import nvimgcodec
    except ImportError as e:
        return None, f"not installed ({e})"
    return nvimgcodec, ""


class NvImageCodecDecoder:
    """Batched GPU decode; created once per loader on one device."""

    name = "nvimgcodec"

    def __init__(self, device: torch.device, *, hw_load: float = 1.0, cpu_threads: int = 2,
                 hw_only: bool = False) -> None:
        nvimgcodec, why = load_nvimgcodec()
        if nvimgcodec is None:
            raise RuntimeError(f"nvImageCodec {why}")
        self._nv = nvimgcodec
        kinds = nvimgcodec.BackendKind
        backends = [nvimgcodec.Backend(kinds.HW_GPU_ONLY, load_hint=hw_load)]
        if not hw_only:  # what the engines refuse goes to nvJPEG's CUDA decoder
            backends.append(nvimgcodec.Backend(kinds.HYBRID_CPU_GPU))
        self.device = device
        # fancy_upsampling=1: the same chroma upsampling as libjpeg-turbo's default (the CPU path),
        # where nvImageCodec's default of 0 differs visibly on 4:2:0 edges.
        self._decoder = nvimgcodec.Decoder(device_id=device.index or 0, max_num_cpu_threads=cpu_threads,
                                           backends=backends, options=":fancy_upsampling=1")
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                               allow_any_depth=False, sample_format=nvimgcodec.SampleFormat.I_RGB)

    def decode(self, datas: Sequence[bytes], stream: torch.cuda.Stream) -> list[torch.Tensor | None]:
        streams, where = [], []
        for i, d in enumerate(datas):
            try:
                streams.append(self._nv.CodeStream(d))
                where.append(i)
            except Exception:  # unparseable for nvImageCodec: the CPU decoder decides
                pass
        out: list[torch.Tensor | None] = [None] * len(datas)
        if not streams:
            return out
        images = self._decoder.decode(streams, params=self._params, cuda_stream=stream.cuda_stream)
        if len(images) != len(streams):
            # Some nvImageCodec versions drop failed entries instead of returning None, which would
            # shift every later image onto the wrong label: decode one at a time to know which failed.
            images = [self._decoder.decode(cs, params=self._params, cuda_stream=stream.cuda_stream) for cs in streams]
        for i, img in zip(where, images):
            if img is not None:
                t = torch.as_tensor(img, device=self.device)
                if t.dim() == 3 and t.shape[2] == 3 and t.dtype == torch.uint8:
                    out[i] = t
        return out
