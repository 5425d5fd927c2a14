"""Who decodes: pick the GPU decoder once, at construction, from what works here."""

from __future__ import annotations

import torch

DECODE_CHOICES = ("auto", "cpu", "gpu", "nvimgcodec", "nvjpeg", "torchvision")


def create_gpu_decoder(choice: str, device: torch.device, *, threads: int = 2):
    """Return (list of ``threads`` decoders, or None; reason). None means: decode on the CPU (workers).

    Several nvImageCodec decoders decode parts of a batch at once, each from its
    own thread on its own CUDA stream (their decode calls release the GIL). On
    the H200 machine, hardware engine only: one decoder 15,420 images/s, two
    17,392, three 16,718 (benchmarks/profile_gpu_stage.py, BENCHMARKS.md).

    "gpu" tries nvImageCodec, then torchvision's nvJPEG decode. "auto" is
    nvImageCodec on a CUDA device when it works, else the CPU workers; it does
    not take torchvision's decoder, whose chroma upsampling differs from the CPU
    path's (28 dB against the CPU decode, where nvImageCodec gives 88). With the
    loader's cpu_share="auto" the workers still decode every image they keep up
    with, so the GPU path is never behind the CPU one by much and far ahead for
    light models: on the 16-core H200 machine (BENCHMARKS.md, session 2)
    ResNet-50 98.2% of its own rate against 98.8% on CPU workers alone, ResNet-18
    61.2% against 46.8%, loader alone 10,419 images/s against 6,546. An
    explicit GPU choice that cannot work raises ValueError saying why.
    """
    if choice not in DECODE_CHOICES:
        raise ValueError(f"decode must be one of {DECODE_CHOICES}, got {choice!r}")
    if choice == "cpu":
        return None, "decode='cpu' asked for"
    if device.type != "cuda":
        if choice == "auto":
            return None, f"decode='auto' on {device}: CPU workers"
        raise ValueError(f"decode={choice!r} needs a CUDA device, got device={str(device)!r}")
    if choice == "auto":
        from ..augment import fused

        if fused.triton is None:  # the per-image torch fallback of the fused kernel is far too slow to pick
            return None, "decode='auto': Triton is not installed (the fused GPU kernel needs it); CPU workers"
    reasons = []
    if choice == "nvjpeg":
        from .nvjpeg_hw import NvJpegHwDecoder

        try:
            decoders = [NvJpegHwDecoder(device) for _ in range(threads)]
        except Exception as e:  # no libnvjpeg, no hardware engine on this GPU
            raise ValueError(f"nvJPEG hardware decoder unavailable: {type(e).__name__}: {e}") from None
        d = decoders[0]
        return decoders, (f"nvJPEG {'.'.join(map(str, d.version))} hardware engines ({d.engines} engines) called "
                          f"directly, {threads} decoder threads; {d.library}")
    if choice in ("auto", "gpu", "nvimgcodec"):
        try:
            from .nvimgcodec import NvImageCodecDecoder

            return ([NvImageCodecDecoder(device) for _ in range(threads)],
                    f"nvImageCodec (hardware engine, then CUDA), {threads} decoder threads")
        except Exception as e:  # missing wheel, no nvJPEG, decoder creation failure: all mean "not here"
            reasons.append(f"nvImageCodec unavailable: {type(e).__name__}: {e}")
            if choice == "nvimgcodec":
                raise ValueError(reasons[-1]) from None
            if choice == "auto":
                return None, f"decode='auto': {reasons[-1]}; CPU workers (pip install gpufeed[nvimgcodec-cu13])"
    try:
        from .torchvision_gpu import TorchvisionGpuDecoder

        return [TorchvisionGpuDecoder(device)], "; ".join(reasons + ["torchvision decode_jpeg on CUDA"])
    except Exception as e:
        reasons.append(f"torchvision GPU decode unavailable: {type(e).__name__}: {e}")
        if choice == "torchvision":
            raise ValueError(reasons[-1]) from None
    return None, "; ".join(reasons + ["CPU decode"])
