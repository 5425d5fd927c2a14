"""Run the pipelines side by side, in one process, and collect what users judge by.

For each pipeline and epoch: wall time, images/s, and, while it runs, GPU
utilisation (NVML) and peak host RSS of the process tree. With a model, each
batch also takes one training step (bf16 autocast, channels_last, SGD), and the
model's own rate on tensors already on the GPU is measured in the same run as
the ceiling.

Under torchrun (an initialised process group) every rank runs the same: the
model is wrapped in DDP (the ceiling too), each rank loads its shard, epochs
start together, and images/s are summed over the ranks; rank 0 reports (GPU
busy and memory of its own GPU, host memory of its own process tree).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..loader import ImageLoader
from ..transfer import prefetch
from ..synth import create_synthetic_dataset
from .baseline import create_baseline_loader
from .recipes import BenchRecipe, load_recipe
from ..cores import cpu_ranges, usable_cores
from .monitor import Monitor

PIPELINES = ("baseline", "baseline+prefetch", "gpufeed", "gpufeed-cpu", "gpufeed-gpu", "gpufeed-gpu-only")
# gpufeed: decode where ImageLoader's "auto" puts it; -cpu / -gpu force the CPU workers / a GPU decoder
# (with the workers decoding the share of each batch that cpu_share="auto" settles on); -gpu-only: the GPU
# decoders alone (cpu_share=0, apart from files they refuse).
_DECODE = {"gpufeed": "auto", "gpufeed-cpu": "cpu", "gpufeed-gpu": "gpu", "gpufeed-gpu-only": "gpu"}


@dataclass(frozen=True)
class BenchConfig:
    """What to run; see ``gpufeed bench --help``."""

    data: str | None = None
    n: int = 2000
    batch_size: int = 64
    workers: int = 2
    epochs: int = 3
    model: str | None = None
    device: str = "cpu"
    pipelines: tuple[str, ...] = ("baseline", "gpufeed")
    storage_options: dict[str, Any] | None = None  # fsspec's, for a URL in ``data``
    recipe: str | None = None  # a training recipe both ways (``bench.recipes``); None: crop + flip + normalise
    compile: bool = False  # the model through torch.compile (its ceiling too)
    cache_dir: str = field(default_factory=lambda: os.path.expanduser("~/.cache/gpufeed"))

    def __post_init__(self) -> None:
        for name, value in (("n", self.n), ("batch_size", self.batch_size), ("workers", self.workers)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.epochs < 2:
            raise ValueError(f"epochs must be >= 2 (the first epoch includes start-up), got {self.epochs}")
        unknown = [p for p in self.pipelines if p not in PIPELINES]
        if unknown:
            raise ValueError(f"unknown pipeline(s) {unknown}; choose from {PIPELINES}")
        if self.model is not None and self.device == "cpu":
            raise ValueError("--model needs a CUDA device (training on the CPU measures the CPU, not the loader)")
        if self.compile and self.model is None:
            raise ValueError("--compile needs --model (it compiles the model that trains)")


def _ranks() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _over_ranks(value: float, device: torch.device, op: str = "SUM") -> float:
    """``value`` reduced over the ranks with ``op`` ("SUM", "MAX"); itself without a process group."""
    if _ranks()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
    return float(t.item())


def _together() -> None:
    """All ranks reach this point before any goes on (epochs start together)."""
    if _ranks()[1] > 1:
        torch.distributed.barrier()


def dataset_root(cfg: BenchConfig) -> str:
    if cfg.data:
        return cfg.data
    root = Path(cfg.cache_dir) / f"synth-{cfg.n}-seed0"
    if _ranks()[0] == 0:
        create_synthetic_dataset(root, n=cfg.n, seed=0)
    _together()
    return str(root)


def make_train_step(name: str, device: torch.device,
                    compile: bool = False) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One SGD step of torchvision model ``name`` under bf16 autocast, channels_last; ``compile``: the model
    through ``torch.compile`` (static shapes: the epoch's last, smaller batch is compiled once more)."""
    import torchvision

    model = torchvision.models.get_model(name, num_classes=1000).to(device).to(memory_format=torch.channels_last)
    if _ranks()[1] > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    if compile:
        model = torch.compile(model, dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def model_rate(step: Callable, images: torch.Tensor, labels: torch.Tensor, seconds: float) -> float:
    """Images/s of ``step`` on one GPU-resident batch over about ``seconds``: the median of 1 s windows, the
    device synchronised at each window's ends (the benchmarks' own rate of a model beside something else)."""
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            step(images, labels)
            n += images.shape[0]
        torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def measure_ceiling(step: Callable, batch_size: int, device: torch.device, monitor: Monitor) -> dict[str, Any]:
    """The model's own images/s on one batch already on the GPU (the end-to-end ceiling)."""
    images = torch.randn(batch_size, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch_size,), device=device)
    for _ in range(10):
        step(images, labels)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        step(images, labels)
    torch.cuda.synchronize(device)
    # about 5 s of steps, at least 30; under DDP the same count on every rank (a step's all-reduce pairs up
    # across ranks: a time limit would leave one rank waiting for a step the others never take)
    steps = int(_over_ranks(max(30.0, math.ceil(5.0 / ((time.perf_counter() - t0) / 10))), device, "MAX"))
    _together()
    monitor.start()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(images, labels)
    torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    monitor.stop()
    return {"pipeline": "GPU-resident tensors (ceiling)", "images_per_s": _over_ranks(steps * batch_size / dt, device),
            "gpu_busy": monitor.gpu_busy, "cpu_cores_busy": monitor.cores_busy, "epochs": []}


def _make_loader(name: str, root: str, cfg: BenchConfig, device: torch.device,
                 recipe: BenchRecipe | None) -> Iterable:
    if name.startswith("baseline") and not os.path.isdir(root):
        raise ValueError(f"the baseline (torchvision's ImageFolder) reads only a local ImageFolder folder, not {root!r}")
    transform = recipe.transform if recipe is not None else None
    if name.startswith("baseline"):
        loader = create_baseline_loader(root, batch_size=cfg.batch_size, num_workers=cfg.workers, transform=transform)
        return prefetch(loader, device) if name == "baseline+prefetch" else loader
    loader = ImageLoader(root, batch_size=cfg.batch_size, num_workers=cfg.workers, device=device,
                         channels_last=cfg.model is not None, decode=_DECODE[name],
                         cpu_share=0.0 if name == "gpufeed-gpu-only" else "auto", storage_options=cfg.storage_options,
                         transform=transform, batch_transform=recipe.batch_transform if recipe is not None else None)
    if name.startswith("gpufeed-gpu") and loader.decode_backend == "cpu":
        loader.close()
        raise ValueError(f"pipeline gpufeed-gpu: no GPU decoder works here ({loader.decode_reason})")
    return loader


def _cpu_share(loader: Iterable) -> float | None:
    """The CPU workers' share of gpufeed's GPU-path batches as an epoch ends (None for the others)."""
    stats = getattr(loader, "stats", None)
    return stats["cpu_share"] if stats is not None and stats["decode_backend"] != "cpu" else None


def run_pipeline(name: str, root: str, cfg: BenchConfig, device: torch.device, step: Callable | None,
                 monitor: Monitor, progress: Callable[[str], Any], recipe: BenchRecipe | None = None) -> dict[str, Any]:
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the CUDA context is this process's, not the loader's
    gpu_before = monitor.gpu_used()  # the loader takes its GPU memory when it is made
    loader = _make_loader(name, root, cfg, device, recipe)
    # the baseline's batch transform on the device, as its script would call it (gpufeed's runs in the loader)
    mix = recipe.batch_transform if recipe is not None and name.startswith("baseline") else None
    epochs = []
    for epoch in range(cfg.epochs):
        sampler = getattr(getattr(loader, "iterable", loader), "sampler", None)  # through a Prefetcher
        if hasattr(sampler, "set_epoch"):  # the baseline's DistributedSampler under DDP
            sampler.set_epoch(epoch)
        bar = progress(f"{name} epoch {epoch + 1}/{cfg.epochs}", len(loader))
        halfway = max(1, len(loader) // 2)  # PSS is read once, while every pipeline's workers run
        _together()
        monitor.start()
        n, t0 = 0, time.perf_counter()
        for batch, (images, labels) in enumerate(loader, 1):
            if mix is not None:
                images, labels = mix(images.to(device, non_blocking=True), labels.to(device, non_blocking=True))
            if step is not None:
                step(images, labels)
            else:
                # Loader only: the batch reaches the device (as training would need) and is read once.
                images.to(device, non_blocking=True).sum()
            n += images.shape[0]
            bar.update(1)
            if batch == halfway:
                monitor.read_pss()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        monitor.stop()
        bar.close()
        epochs.append({"seconds": dt, "images": int(_over_ranks(n, device)), "images_per_s": _over_ranks(n / dt, device),
                       "gpu_busy": monitor.gpu_busy,
                       "cpu_cores_busy": monitor.cores_busy,
                       "peak_rss_bytes": monitor.peak_rss, "start_rss_bytes": monitor.start_rss,
                       "peak_pss_bytes": monitor.peak_pss, "start_pss_bytes": monitor.start_pss,
                       "gpu_mem_start_bytes": monitor.gpu_mem_start, "gpu_mem_peak_bytes": monitor.gpu_mem_peak,
                       "cpu_share": _cpu_share(loader)})
    stats = getattr(loader, "stats", None)
    close = getattr(loader, "close", None)
    if close:
        close()
    del loader
    steady = epochs[1:]
    busy = [e["gpu_busy"] for e in steady if e["gpu_busy"] is not None]
    cores = [e["cpu_cores_busy"] for e in steady if e["cpu_cores_busy"] is not None]
    label = name
    if stats is not None:
        share = "" if stats["decode_backend"] == "cpu" else f", CPU share {stats['cpu_share']:.2f}"
        if stats.get("worker_cpus"):
            share += f", workers on CPUs {cpu_ranges(set(stats['worker_cpus']))}"
        ops = stats.get("auto_augment_ops")
        if ops:
            share += ", auto-augment ops in " + ("Triton" if ops.startswith("two Triton") else "PyTorch passes")
        label = f"{name} ({stats['decode_backend']} decode{share})"
    gpu_added = [e["gpu_mem_peak_bytes"] - gpu_before for e in epochs
                 if e["gpu_mem_peak_bytes"] is not None and gpu_before is not None]
    return {
        "pipeline": label,
        "loader_stats": stats,
        "gpu_mem_added_bytes": max(gpu_added) if gpu_added else None,
        "gpu_mem_before_loader_bytes": gpu_before,
        "epochs": epochs,
        "first_epoch_s": epochs[0]["seconds"],
        "steady_epoch_s": statistics.median(e["seconds"] for e in steady),
        "images_per_s": statistics.median(e["images_per_s"] for e in steady),
        "gpu_busy": statistics.median(busy) if busy else None,
        "cpu_cores_busy": statistics.median(cores) if cores else None,
        "peak_rss_bytes": max(e["peak_rss_bytes"] for e in epochs),
        "added_rss_bytes": max(e["peak_rss_bytes"] for e in epochs) - epochs[0]["start_rss_bytes"],
        "added_pss_bytes": (max(e["peak_pss_bytes"] for e in epochs) - epochs[0]["start_pss_bytes"]
                            if all(e["peak_pss_bytes"] for e in epochs) and epochs[0]["start_pss_bytes"] else None),
    }


def machine_description() -> dict[str, Any]:
    desc = {"host": platform.node(), "cpu_cores": usable_cores(), "python": sys.version.split()[0],
            "torch": torch.__version__, "gpu": None, "ranks": _ranks()[1]}
    if torch.cuda.is_available():
        desc["gpu"] = torch.cuda.get_device_name()
        if desc["ranks"] > 1:
            desc["gpu"] = f"{desc['ranks']}x {desc['gpu']}"
    return desc


def run_bench(cfg: BenchConfig, progress: Callable[[str, int], Any]) -> dict[str, Any]:
    """Run every pipeline in ``cfg``; returns the results as plain data (what --json writes)."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    root = dataset_root(cfg)
    monitor = Monitor(device.index if device.type == "cuda" else None)
    step = make_train_step(cfg.model, device, cfg.compile) if cfg.model else None
    rows = []
    ceiling = None
    if step is not None:
        ceiling = measure_ceiling(step, cfg.batch_size, device, monitor)
        rows.append(ceiling)
    recipe = load_recipe(cfg.recipe) if cfg.recipe else None
    for name in cfg.pipelines:
        try:
            rows.append(run_pipeline(name, root, cfg, device, step, monitor, progress, recipe))
        except Exception as e:  # one pipeline failing must not lose the others' numbers
            if _ranks()[1] > 1:  # but under DDP the other ranks wait in its collectives: stop them all
                raise
            rows.append({"pipeline": f"{name} (FAILED: {type(e).__name__}: {str(e)[:120]})", "images_per_s": None,
                         "error": traceback.format_exc(), "epochs": []})
    base = next((r["images_per_s"] for r in rows if r["pipeline"] == "baseline"), None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for r in rows:
        rate = r["images_per_s"]
        r["vs_baseline"] = rate / base if base and rate else None
        r["of_ceiling"] = rate / ceiling["images_per_s"] if ceiling and rate else None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["gpufeed", *sys.argv[1:]]) if Path(sys.argv[0]).name == "gpufeed" else " ".join(sys.argv),
        "machine": machine_description(),
        "config": asdict(cfg),
        "dataset": root,
        "nvml": "ok" if monitor._nvml is not None else (monitor.nvml_error or "not used (no GPU)"),
        "rows": rows,
    }
