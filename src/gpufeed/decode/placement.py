"""Who decodes: pick the GPU decoder once, at construction, from what works here."""

from __future__ import annotations

import torch

DECODE_CHOICES = ("auto", "cpu", "gpu", "nvimgcodec", "torchvision")


def create_gpu_decoder(choice: str, device: torch.device, *, threads: int = 2):
    """Return (list of ``threads`` decoders, or None; reason). None means: decode on the CPU (workers).

    Several nvImageCodec decoders decode parts of a batch at once, each from its
    own thread on its own CUDA stream (their decode calls release the GIL). On
    the H200 machine, hardware engine only: one decoder 15,420 images/s, two
    17,392, three 16,718 (benchmarks/profile_gpu_stage.py, BENCHMARKS.md).

    "gpu" tries nvImageCodec, then torchvision's nvJPEG decode. "auto" is the
    CPU workers for now, on any device: on the 16-core H200 machine they fed
    ResNet-50 at 94% of its own rate against 75% for GPU decode (BENCHMARKS.md);
    GPU decode led only for light models. An explicit GPU choice that cannot
    work raises ValueError saying why.
    """
    if choice not in DECODE_CHOICES:
        raise ValueError(f"decode must be one of {DECODE_CHOICES}, got {choice!r}")
    if choice == "cpu":
        return None, "decode='cpu' asked for"
    if choice == "auto":
        return None, "decode='auto': CPU workers (measured faster end to end than GPU decode on heavy models)"
    if device.type != "cuda":
        raise ValueError(f"decode={choice!r} needs a CUDA device, got device={str(device)!r}")
    reasons = []
    if choice in ("gpu", "nvimgcodec"):
        try:
            from .nvimgcodec import NvImageCodecDecoder

            return ([NvImageCodecDecoder(device) for _ in range(threads)],
                    f"nvImageCodec (hardware engine, then CUDA), {threads} decoder threads")
        except Exception as e:  # missing wheel, no nvJPEG, decoder creation failure: all mean "not here"
            reasons.append(f"nvImageCodec unavailable: {type(e).__name__}: {e}")
            if choice == "nvimgcodec":
                raise ValueError(reasons[-1]) from None
    try:
        from .torchvision_gpu import TorchvisionGpuDecoder

        return [TorchvisionGpuDecoder(device)], "; ".join(reasons + ["torchvision decode_jpeg on CUDA"])
    except Exception as e:
        reasons.append(f"torchvision GPU decode unavailable: {type(e).__name__}: {e}")
        if choice == "torchvision":
            raise ValueError(reasons[-1]) from None
    return None, "; ".join(reasons + ["CPU decode"])
