"""`gpufeed info`: what this environment has, and which decode backends work here."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nvml_lines() -> list[str]:
    try:
        import pynvml
    except ImportError:
        return ["NVML: not installed (pip install 'gpufeed[nvml]' to read GPU utilisation)"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [f"NVML: installed, but no driver answered ({e})"]
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


def collect_info() -> dict[str, str]:
    """Versions, hardware and backends as (name, value) text."""
    import torch

    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu cores (usable)": str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
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
    for line in _nvml_lines():
        name, _, value = line.partition(": ")
        info[name] = value
    info["decode: cpu (simplejpeg + Pillow)"] = _probe_cpu_decode()
    return info


def format_info(info: dict[str, str]) -> str:
    width = max(len(k) for k in info)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in info.items())
