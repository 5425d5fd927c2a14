"""`gpufeed info`: what this environment has, and which decode backends work here."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Callable


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nvml_lines(cuda: bool) -> list[str]:
    try:
        import pynvml
    except ImportError:
        return ["NVML: not installed (pip install 'gpufeed[nvml]' to read GPU utilisation)"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [f"NVML: installed, but no driver answered ({e})" if cuda else "NVML: not used (no NVIDIA driver here)"]
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        return [f"NVML: driver {driver.decode() if isinstance(driver, bytes) else driver}"]
    finally:
        pynvml.nvmlShutdown()


def _probe_cpu_decode() -> str:
    import numpy as np

    from .decode.cpu import CpuDecoder
    from .synth import synthetic_jpeg

    data, (w, h) = synthetic_jpeg(np.random.default_rng(0))
    dec = CpuDecoder()
    _, _, fast = dec.header(data, "<probe>")
    img = dec.decode(data, "<probe>", fast=fast)
    ok = img.shape == (h, w, 3)
    return "works" if ok else f"FAILED (decoded shape {img.shape}, expected {(h, w, 3)})"


def _probe_gpu_decode(choice: str) -> str:
    """Decode one synthetic JPEG with a GPU decoder and compare it with the CPU decode."""
    import numpy as np
    import torch

    from .decode.base import DecodeJob
    from .decode.cpu import CpuDecoder
    from .placement import create_gpu_decoders
    from .synth import synthetic_jpeg

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        decoders, _ = create_gpu_decoders(choice, torch.device("cuda", torch.cuda.current_device()))
        data, (w, h) = synthetic_jpeg(np.random.default_rng(0))
        img = torch.full((h, w, 3), 7, dtype=torch.uint8, device="cuda")
        job = DecodeJob.of([np.frombuffer(data, np.uint8)], [img])
        ok = bool(decoders[0].decode(job, torch.cuda.current_stream())[0])
        torch.cuda.synchronize()
    except Exception as e:  # report any failure as "does not work here", with the reason
        return f"does not work here ({type(e).__name__}: {str(e)[:160]})"
    if not ok:
        return f"FAILED (a {w}x{h} baseline JPEG was not decoded)"
    ref = CpuDecoder().decode(data, "<probe>", fast=True).astype(np.float64)
    mse = float(((img.cpu().numpy().astype(np.float64) - ref) ** 2).mean())
    psnr = 99.0 if mse == 0 else 10 * np.log10(255**2 / mse)
    how = {True: ", decodes in place", False: ", decodes then copies"}.get(getattr(decoders[0], "in_place", None), "")
    return f"works (PSNR {psnr:.1f} dB against the CPU decode{how})"


def data_access() -> dict[str, str]:
    """Which URL schemes ImageLoader can read here (through fsspec and the scheme's package), and Parquet."""
    from .sources.urls import scheme_status

    out = {"fsspec": _version("fsspec")}
    for proto, package in (("s3", "s3fs"), ("gs", "gcsfs"), ("az", "adlfs"), ("https", "aiohttp"), ("file", "fsspec")):
        status = scheme_status(proto)
        out[f"URLs {proto}://"] = f"{status}, {package} {_version(package)}" if status == "yes" else status
    try:
        import pyarrow  # noqa: F401

        out["Parquet tables"] = f"yes, pyarrow {_version('pyarrow')}"
    except ImportError:
        out["Parquet tables"] = "no (pip install 'gpufeed[parquet]' for pyarrow)"
    return out


def collect_info(say: Callable[[str], None] = lambda line: None) -> dict[str, str]:
    """Versions, hardware and backends as (name, value) text; ``say(line)`` is told before each probe that
    may take seconds (importing torch, a decoder's first use, a kernel's compilation)."""
    say("importing torch")
    import torch

    from .cores import affinity, cpu_limit, cpu_ranges, usable_cores
    from .placement import worker_cpus
    from .placement.cpus import KEEP_FROM_CPUS

    limit = cpu_limit()
    kept = worker_cpus(gpu_path=True)
    cuda = torch.cuda.is_available()
    if not cuda:
        workers = "no GPU here: the workers use every usable core"
    elif kept is None:
        workers = f"all (under {KEEP_FROM_CPUS} cores, none is kept from the workers for the training process)"
    else:
        workers = f"{cpu_ranges(kept)} ({cpu_ranges(affinity() - kept)} kept for the training process)"
    info = {
        "this machine": ("CUDA: ImageLoader(device='auto') decodes on the GPU and the CPU workers" if cuda else
                         f"CPU only: ImageLoader(device='auto') decodes and augments on {usable_cores()} CPU "
                         "core(s); the GPU lines below say 'no CUDA device'"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu cores (usable)": f"{usable_cores()} ({len(affinity())} in the affinity mask, "
                              + ("no cgroup CPU quota)" if limit is None else f"cgroup CPU quota {limit:g})"),
        "GPU path: workers' CPUs": workers,
        "gpufeed": _version("gpufeed"),
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "pillow": _version("pillow"),
        "simplejpeg": _version("simplejpeg"),
        "opencv": _version("opencv-python-headless"),
        "nvimgcodec": next((v for v in (_version("nvidia-nvimgcodec-cu13"), _version("nvidia-nvimgcodec-cu12"))
                            if v != "not installed"), "not installed"),
        "torch CUDA build": str(torch.version.cuda or "none (CPU build)"),
        "CUDA available": str(torch.cuda.is_available()),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info[f"gpu {i}"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
    for line in _nvml_lines(cuda):
        name, _, value = line.partition(": ")
        info[name] = value
    say("probing the CPU decoder")
    info["decode: cpu (simplejpeg + Pillow)"] = _probe_cpu_decode()
    from .decode.cpu import CROPPED_DECODE_MISSING, cropped_decode_available

    info["decode: cpu cropped (libjpeg-turbo ext)"] = (
        "built: JPEG decode cost follows the crop" if cropped_decode_available() else f"NO: {CROPPED_DECODE_MISSING}")
    from .decode.nvjpeg_hw import load_nvjpeg

    info["libnvjpeg"] = load_nvjpeg()[1]
    for name, choice in (("nvjpeg hardware engines", "nvjpeg"), ("nvimgcodec", "nvimgcodec"),
                         ("torchvision", "torchvision")):
        if cuda:
            say(f"probing the GPU decoder {choice}")
        info[f"decode: {name} (GPU)"] = _probe_gpu_decode(choice)
    if cuda:
        say("probing the auto-augment ops' GPU kernels (the first use compiles them)")
    info["per-sample auto-augment ops (GPU)"] = _probe_ops_kernels()
    info.update(data_access())
    from .placement import create_gpu_decoders

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    info["ImageLoader decode='auto' uses"] = create_gpu_decoders("auto", device)[1]
    return info


def _probe_ops_kernels() -> str:
    """Every colour and point operation of the auto-augment family once on a small CUDA batch, through what
    runs them here, compared with the PyTorch passes."""
    import torch

    from .augment.ops import apply_operations, apply_passes, kernels

    if not torch.cuda.is_available():
        return "no CUDA device (PyTorch passes on the CPU)"
    names = sorted(kernels.CODES)
    images = torch.randint(0, 256, (len(names), 3, 16, 16), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    steps = [(name, 4.0 if name == "Posterize" else 0.5 if name == "Solarize" else 0.3) for name in names]
    try:
        ours = apply_operations(images.cuda(), steps).cpu()
        used = kernels.describe()  # after the run: a launch that failed says so
        if not kernels.usable(images.cuda()):
            return used
        reference = apply_passes(images.cuda(), steps).cpu()
    except Exception as e:  # a probe reports, it does not raise
        return f"FAILED ({type(e).__name__}: {e})"
    differ = int((ours != reference).sum())
    largest = int((ours.int() - reference.int()).abs().max())
    return f"{used}: " + ("works (the PyTorch passes' pixels)" if differ == 0 else
                          f"{differ} of {ours.numel()} values differ from the PyTorch passes by up to {largest} "
                          f"level{'s' if largest > 1 else ''}")


def format_info(info: dict[str, str], columns: int = 100) -> str:
    """One line per entry, the values in a column, each wrapped at its spaces to fit ``columns`` (a word longer
    than the room, a path, stands whole on its own line)."""
    import textwrap

    width = max(len(k) for k in info)
    room = max(columns - width - 2, 20)
    return "\n".join(f"{k:<{width}}  " + f"\n{'':<{width}}  ".join(
        textwrap.wrap(v, room, break_long_words=False, break_on_hyphens=False) or [""]) for k, v in info.items())
