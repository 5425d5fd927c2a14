"""Which GPU decoder, if any, a loader uses: chosen once, when it is made."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .memory import ENGINE_ROOM_SIDE

if TYPE_CHECKING:
    import torch

    from ..augment.params import AugmentSpec

DECODE_CHOICES = ("auto", "cpu", "gpu", "nvimgcodec", "nvjpeg", "torchvision")
# what each GPU choice tries, in order; "auto" never takes torchvision's decoder, whose chroma upsampling
# differs from the CPU path's (28 dB against the CPU decode, where the other two give 88), and which runs at
# less than half nvJPEG's rate (BENCHMARKS.md#gpu-decode-backends)
_ORDER = {"auto": ("nvjpeg", "nvimgcodec"), "gpu": ("nvjpeg", "nvimgcodec", "torchvision"),
          "nvjpeg": ("nvjpeg",), "nvimgcodec": ("nvimgcodec",), "torchvision": ("torchvision",)}
# Decoder threads per loader: two keep the engines busy while one thread's host work runs
# (BENCHMARKS.md#gpu-decode-backends).
DECODER_THREADS = 2


def decode_call_images(batch_size: int, job_images: int) -> int:
    """The most images one decode call is given: a batch's encoded images are dealt to the decoder threads
    in calls of at most ``job_images`` (``GpuDecodeAugment``)."""
    return min(job_images, -(-batch_size // DECODER_THREADS))


def cpu_crops(augment: "AugmentSpec") -> str | None:
    """Why the CPU workers make all of a recipe's crops (None: the GPU path serves it). The GPU stage makes
    training's resampled box (``AugmentSpec.box_crop``: RandomResizedCrop, ``augment.fused``) and validation's
    Resize + CenterCrop (``augment.center_crop``, in Pillow's arithmetic); a RandomCrop crops without resampling."""
    if augment.box_crop or not augment.train:
        return None
    return ("RandomCrop: CPU workers, which crop without resampling as torchvision does (the GPU decoders serve "
            "RandomResizedCrop recipes and validation)")


def create_gpu_decoders(choice: str, device: "torch.device", *, recipe: str | None = None,
                        batch_size: int = 256) -> tuple[list | None, str]:
    """(GPU decoders, or None for the CPU workers; why). Several decoders decode parts of a batch at once,
    each from its own thread on its own CUDA stream (their calls release the GIL). ``recipe``: why the
    recipe's crops are the CPU workers' (``cpu_crops``), so that no GPU decoder is made for it; None: a
    resampled-box crop, which the GPU path serves.
    ``batch_size``: nvJPEG's engine decoders take their device memory for calls of that batch now.

    "gpu" and "auto" try, in order: the NVJPG hardware engines through nvJPEG's batched API called
    directly ("nvjpeg"); nvImageCodec, whose CUDA decoder also serves GPUs without engines
    ("nvimgcodec"); and, for "gpu" only, torchvision's decode_jpeg on CUDA. "auto" stays on the CPU
    workers without nvJPEG or nvImageCodec, or without Triton (the fused kernel's per-image torch
    fallback is far too slow to pick). An explicit single choice that cannot work raises ValueError
    saying why.
    """
    if choice not in DECODE_CHOICES:
        raise ValueError(f"decode must be one of {DECODE_CHOICES}, got {choice!r}")
    if choice == "cpu":
        return None, "decode='cpu' asked for"
    if recipe is not None:
        return None, recipe
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
            decoders, how = _MAKERS[name](device, batch_size)
        except Exception as e:  # missing library, no engines on this GPU, decoder creation failure: "not here"
            reasons.append(f"{name} unavailable: {type(e).__name__}: {e}")
            continue
        return decoders, "; ".join(reasons + [how])
    if choice in _MAKERS:
        raise ValueError(reasons[-1])
    if choice == "auto":
        return None, ("decode='auto': " + "; ".join(reasons)
                      + "; CPU workers (pip install gpufeed[nvjpeg-cu13] or gpufeed[nvimgcodec-cu13])")
    return None, "; ".join(reasons + ["CPU decode"])


def _nvjpeg(device: "torch.device", batch_size: int) -> tuple[list, str]:
    from ..decode.nvjpeg_hw import NvJpegHwDecoder

    images = decode_call_images(batch_size, NvJpegHwDecoder.job_images)
    decoders = [NvJpegHwDecoder(device, call_images=images, max_side=ENGINE_ROOM_SIDE) for _ in range(DECODER_THREADS)]
    d = decoders[0]
    return decoders, (f"nvJPEG {'.'.join(map(str, d.version))} hardware engines ({d.engines} engines) called "
                      f"directly, {DECODER_THREADS} decoder threads ({d.library})")


def _nvimgcodec(device: "torch.device", batch_size: int) -> tuple[list, str]:
    from ..decode.nvimgcodec import NvImageCodecDecoder

    return ([NvImageCodecDecoder(device) for _ in range(DECODER_THREADS)],
            f"nvImageCodec (hardware engine, then CUDA), {DECODER_THREADS} decoder threads")


def _torchvision(device: "torch.device", batch_size: int) -> tuple[list, str]:
    from ..decode.torchvision_gpu import TorchvisionGpuDecoder

    return [TorchvisionGpuDecoder(device)], "torchvision decode_jpeg on CUDA"


_MAKERS = {"nvjpeg": _nvjpeg, "nvimgcodec": _nvimgcodec, "torchvision": _torchvision}
