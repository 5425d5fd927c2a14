"""Who decodes: pick the GPU decoder once, at construction, from what works here."""

from __future__ import annotations

import torch

DECODE_CHOICES = ("auto", "cpu", "nvimgcodec", "torchvision")


def create_gpu_decoder(choice: str, device: torch.device, *, threads: int = 2):
    """Return (list of ``threads`` decoders, or None; reason). None means: decode on the CPU (workers).

    Several decoders decode parts of a batch at once from as many threads (their
    decode calls release the GIL); nvImageCodec's hardware engines saturate at
    2-3 concurrent callers.

    "auto" on a CUDA device tries nvImageCodec, then torchvision's nvJPEG
    decode; on the CPU it is always "cpu". An explicit GPU choice that cannot
    work raises ValueError saying why.
    """
    if choice not in DECODE_CHOICES:
        raise ValueError(f"decode must be one of {DECODE_CHOICES}, got {choice!r}")
    if choice == "cpu":
        return None, "decode='cpu' asked for"
    if device.type != "cuda":
        if choice != "auto":
            raise ValueError(f"decode={choice!r} needs a CUDA device, got device={str(device)!r}")
        return None, "device is the CPU"
    reasons = []
    if choice in ("auto", "nvimgcodec"):
        try:
            from .nvimgcodec import NvImageCodecDecoder

            return [NvImageCodecDecoder(device) for _ in range(threads)], "nvImageCodec (hardware engine, then CUDA)"
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
