"""Who decodes: pick the GPU decoder once, at construction, from what works here."""

from __future__ import annotations

import torch

DECODE_CHOICES = ("auto", "cpu", "gpu", "nvimgcodec", "nvjpeg", "torchvision")


def _nvjpeg(device: torch.device, threads: int):
    from .nvjpeg_hw import NvJpegHwDecoder

    decoders = [NvJpegHwDecoder(device) for _ in range(threads)]
    d = decoders[0]
    return decoders, (f"nvJPEG {'.'.join(map(str, d.version))} hardware engines ({d.engines} engines) called "
                      f"directly, {threads} decoder threads ({d.library})")


def _nvimgcodec(device: torch.device, threads: int):
    from .nvimgcodec import NvImageCodecDecoder

    return [NvImageCodecDecoder(device) for _ in range(threads)], \
        f"nvImageCodec (hardware engine, then CUDA), {threads} decoder threads"


def _torchvision(device: torch.device, threads: int):
    from .torchvision_gpu import TorchvisionGpuDecoder

    return [TorchvisionGpuDecoder(device)], "torchvision decode_jpeg on CUDA"


_MAKERS = {"nvjpeg": _nvjpeg, "nvimgcodec": _nvimgcodec, "torchvision": _torchvision}
# what each choice tries, in order; "auto" never takes torchvision's decoder (see below)
_ORDER = {"auto": ("nvjpeg", "nvimgcodec"), "gpu": ("nvjpeg", "nvimgcodec", "torchvision"),
          "nvjpeg": ("nvjpeg",), "nvimgcodec": ("nvimgcodec",), "torchvision": ("torchvision",)}


def create_gpu_decoder(choice: str, device: torch.device, *, threads: int = 2):
    """Return (list of decoders, or None; reason). None means: decode on the CPU (workers).

    Several decoders decode parts of a batch at once, each from its own thread on
    its own CUDA stream (their decode calls release the GIL).

    "gpu" and "auto" try, in order: the NVJPG hardware engines through nvJPEG's
    batched API called directly ("nvjpeg"); nvImageCodec, whose CUDA decoder
    also serves GPUs without engines ("nvimgcodec"); and, for "gpu" only,
    torchvision's decode_jpeg on CUDA. On the H200 machine, files in memory,
    batch 256, decode + the fused augment kernel: nvjpeg 20,808-20,870
    images/s, nvImageCodec 10,379-11,843, torchvision 8,974 (BENCHMARKS.md,
    session 4). "auto" never takes torchvision's decoder, whose chroma
    upsampling differs from the CPU path's (28 dB against the CPU decode, where
    the other two give 88); without nvJPEG or nvImageCodec, or without Triton
    (the fused kernel's per-image torch fallback is far too slow to pick), it
    stays on the CPU workers. An explicit single choice that cannot work raises
    ValueError saying why.
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

        if fused.triton is None:
            return None, "decode='auto': Triton is not installed (the fused GPU kernel needs it); CPU workers"
    reasons = []
    for name in _ORDER[choice]:
        try:
            decoders, how = _MAKERS[name](device, threads)
        except Exception as e:  # missing library, no engines on this GPU, decoder creation failure: "not here"
            reasons.append(f"{name} unavailable: {type(e).__name__}: {e}")
            continue
        return decoders, "; ".join(reasons + [how])
    if choice in _MAKERS:
        raise ValueError(reasons[-1])
    if choice == "auto":
        return None, "decode='auto': " + "; ".join(reasons) + "; CPU workers (pip install gpufeed[nvjpeg-cu13] or gpufeed[nvimgcodec-cu13])"
    return None, "; ".join(reasons + ["CPU decode"])
