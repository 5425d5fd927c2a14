"""One pipeline's epochs, timed as a plain training loop, and what they add up to.

Each pipeline runs ``epochs`` epochs and one more:

    epoch 1        warm-up: start-up included (workers, the first batches), monitored; reported on its own
    epochs 2..E    plain, monitored, then two plain for each monitored one (3 timed epochs: plain, monitored,
                   plain; 4: plain, monitored, plain, plain)
    epoch E + 1    memory: monitored, with the tree's PSS read once halfway through

A plain epoch is ``for images, labels in loader: step(images, labels)`` with nothing else in the process:
no sampling, no progress bar; images/s is the median of the plain epochs. Monitored epochs give GPU busy,
the cores busy and RSS (read by the sampler process, ``bench.monitor``), and the bench's own overhead: how
much slower they ran than the plain ones. PSS is read only in the memory epoch, whose time counts for
nothing, since the read stalls every process of the tree while it walks their page tables.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Iterable

import torch

from ..cores import cpu_ranges
from ..loader import ImageLoader
from ..transfer import prefetch
from .baseline import create_baseline_loader
from .monitor import Monitor, Reading
from .progress import EpochBar, EpochReport, Progress
from .ranks import over_ranks, ranks, together
from .recipes import BenchRecipe
from .train import TrainStep, ceiling_rate, resident_batch

PIPELINES = ("baseline", "baseline+prefetch", "gpufeed", "gpufeed-cpu", "gpufeed-gpu", "gpufeed-gpu-only")
# What each pipeline is, before it runs (after, gpufeed's rows say what ran: ``describe``).
PLANNED = {
    "gpufeed": "decode where ImageLoader's 'auto' puts it",
    "gpufeed-cpu": "decode in the CPU workers",
    "gpufeed-gpu": "a GPU decoder, the CPU workers taking the share of each batch cpu_share='auto' settles on",
    "gpufeed-gpu-only": "the GPU decoders alone (cpu_share=0, apart from files they refuse)",
}
_DECODE = {"gpufeed": "auto", "gpufeed-cpu": "cpu", "gpufeed-gpu": "gpu", "gpufeed-gpu-only": "gpu"}

CEILING = "the model training on one batch already on the GPU: its own rate"

# Fewer batches an epoch than this, and the start of each epoch and its end weigh in its rate.
FEW_BATCHES = 20
# Plain epochs further apart than this are not a steady rate: the table says so and gives their spread.
UNSTEADY = 0.05
# Monitored epochs slower than plain ones by more than this (and than the plain epochs' own spread): the table
# says the monitors cost that much.
OVERHEAD_WARNING = 0.01
# Other processes keeping more than this share of the machine's cores (and one core at least) busy while the
# monitored epochs ran: the table says the figures are what a shared machine gave.
SHARED = 0.1


def epoch_kinds(epochs: int) -> list[str]:
    """The kind of each epoch a pipeline runs (see the module docstring): two plain epochs for each monitored one
    past the first three, so that from 4 timed epochs the rate is the middle of three plain ones, not the mean of
    two with the first after the warm-up (often the slowest) among them."""
    return ["warm-up"] + ["monitored" if i % 3 == 1 else "plain" for i in range(epochs - 1)] + ["memory"]


def check_baseline_reads(root: str) -> None:
    """ValueError unless ``root`` is a local folder, the only data torchvision's ImageFolder reads."""
    if not os.path.isdir(root):
        raise ValueError(f"the baseline (torchvision's ImageFolder) reads only a local ImageFolder folder, not "
                         f"{root!r}; leave baseline out of --pipelines")


def make_loader(name: str, root: str, cfg: Any, device: torch.device, recipe: BenchRecipe | None) -> Iterable:
    """The loader of pipeline ``name`` (``PIPELINES``) for ``cfg`` (a ``BenchConfig``)."""
    if name.startswith("baseline"):
        check_baseline_reads(root)
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


def _epoch(loader: Iterable, step: TrainStep | None, device: torch.device, mix: Callable | None,
           pss_at: int | None, monitor: Monitor) -> tuple[int, float]:
    """One epoch as a training loop runs it: (images, seconds), the device synchronised at its end. Loader
    only (``step`` None), each batch is still moved to the device (a no-op for gpufeed's)."""
    n, t0 = 0, time.perf_counter()
    for batch, (images, labels) in enumerate(loader, 1):
        if mix is not None:
            images, labels = mix(images.to(device, non_blocking=True), labels.to(device, non_blocking=True))
        if step is not None:
            step(images, labels)
        elif images.device != device:
            images = images.to(device, non_blocking=True)
        n += images.shape[0]
        if batch == pss_at:
            monitor.read_pss()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n, time.perf_counter() - t0


def _set_epoch(loader: Iterable, epoch: int) -> None:
    sampler = getattr(getattr(loader, "iterable", loader), "sampler", None)  # through a Prefetcher
    if hasattr(sampler, "set_epoch"):  # the baseline's DistributedSampler under DDP; ImageLoader's own
        sampler.set_epoch(epoch)


def run_pipeline(name: str, root: str, cfg: Any, device: torch.device, step: TrainStep | None, monitor: Monitor,
                 recipe: BenchRecipe | None = None, report: EpochReport | None = None) -> dict[str, Any]:
    """Every epoch of pipeline ``name``, each reported to ``report`` as it ends (None: a bar or lines on
    standard error, from rank 0); returns its row (see ``summarise``)."""
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the CUDA context is this process's, not the loader's
        if step is not None:  # the training's own memory (weights, activations, optimiser state) too
            for _ in range(2):
                step(*resident_batch(cfg.batch_size, device))
            torch.cuda.synchronize(device)
    before = monitor.now(pss=True)  # before the loader takes its memory, host and GPU
    loader = make_loader(name, root, cfg, device, recipe)
    # the baseline's batch transform on the device, as its script would call it (gpufeed's runs in the loader)
    mix = recipe.batch_transform if recipe is not None and name.startswith("baseline") else None
    kinds = epoch_kinds(cfg.epochs)
    bar = EpochBar(name, kinds, Progress(quiet=ranks()[0] != 0)) if report is None else None
    report = report or bar
    epochs, readings = [], []
    try:
        for index, kind in enumerate(kinds):
            _set_epoch(loader, index)
            pss_at = max(1, len(loader) // 2) if kind == "memory" else None
            together()
            if kind != "plain":
                monitor.start()
            n, seconds = _epoch(loader, step, device, mix, pss_at, monitor)
            readings.append(monitor.stop() if kind != "plain" else None)  # read once the epochs are over
            epochs.append({"kind": kind, "seconds": seconds, "images": int(over_ranks(n, device)),
                           "images_per_s": over_ranks(n / seconds, device), "cpu_share": _cpu_share(loader)})
            report.ended(seconds, epochs[-1]["images_per_s"])
        stats = getattr(loader, "stats", None)
        batches = len(loader)
    finally:
        if bar is not None:
            bar.close()
        close = getattr(loader, "close", None)
        if close:
            close()
    for epoch, pending in zip(epochs, readings):
        epoch.update((pending.get() if pending is not None else Reading()).__dict__)
    return summarise(name, epochs, stats, batches, before, workers=cfg.workers, synthetic=cfg.data is None)


def _cpu_share(loader: Iterable) -> float | None:
    """The CPU workers' share of gpufeed's GPU-path batches as an epoch ends (None for the others)."""
    stats = getattr(loader, "stats", None)
    return stats["cpu_share"] if stats is not None and stats["decode_backend"] != "cpu" else None


def describe(name: str, stats: dict[str, Any] | None, workers: int) -> str:
    """What ran as pipeline ``name``: the baseline's loader, or for gpufeed its decoder, CPU share, worker
    CPUs and ops (from its ``stats``)."""
    if name.startswith("baseline"):
        text = f"torchvision ImageFolder + DataLoader ({workers} worker{'s' if workers != 1 else ''})"
        return text + ", batches through gpufeed.prefetch" if name == "baseline+prefetch" else text
    if stats is None:
        return PLANNED[name]
    share = "" if stats["decode_backend"] == "cpu" else f", CPU share {stats['cpu_share']:.2f}"
    if stats.get("worker_cpus"):
        share += f", workers on CPUs {cpu_ranges(set(stats['worker_cpus']))}"
    ops = stats.get("auto_augment_ops")
    if ops:
        share += ", auto-augment ops in " + ("Triton" if ops.startswith("two Triton") else "PyTorch passes")
    return f"{stats['decode_backend']} decode{share}"


def _few_batches(batches: int, synthetic: bool) -> str:
    more = "more images (--n)" if synthetic else "more images in --data"
    return (f"{batches} batches an epoch: the start and end of each epoch weigh in, so its rate and the ratios "
            f"are not steady figures (use {more}, or a smaller --batch-size)")


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _added(peaks: list[int | None], before: int | None) -> int | None:
    peaks = [p for p in peaks if p is not None]
    return max(peaks) - before if peaks and before is not None else None


def summarise(name: str, epochs: list[dict[str, Any]], stats: dict[str, Any] | None, batches: int,
              before: dict[str, Any], *, workers: int, synthetic: bool) -> dict[str, Any]:
    """A pipeline's row: images/s (median of the plain epochs), the monitored epochs' rate and readings, the
    bench's overhead (plain over monitored, less one), what memory the pipeline added since before its loader
    was made (``before``: ``Monitor.now``; PSS from the memory epoch), and warnings (their advice for the
    bench's synthetic data or the user's, ``synthetic``). ``pipeline``: the name and, for gpufeed, what ran;
    ``detail``: what ran (``describe``)."""
    plain = [e["images_per_s"] for e in epochs if e["kind"] == "plain"]
    watched = [e for e in epochs if e["kind"] == "monitored"] or [e for e in epochs if e["kind"] == "memory"]
    rate, watched_rate = _median(plain), _median([e["images_per_s"] for e in watched])
    overhead = (rate / watched_rate - 1) if rate and watched_rate and any(e["kind"] == "monitored" for e in epochs) else None
    spread = (max(plain) / min(plain) - 1) if len(plain) > 1 else None
    warnings = []
    if batches < FEW_BATCHES:
        warnings.append(_few_batches(batches, synthetic))
    if spread is not None and spread > UNSTEADY:
        warnings.append(f"plain epochs not steady: {min(plain):,.0f}-{max(plain):,.0f} images/s (min-max, "
                        f"{100 * spread:.0f}% apart)")
    if overhead is not None and overhead > max(OVERHEAD_WARNING, spread or 0.0):
        warnings.append(f"the bench's monitors cost {100 * overhead:.1f}% (monitored epochs against plain ones, "
                        f"beyond the plain epochs' own spread of {100 * (spread or 0.0):.1f}%)")
    others = _median([e["machine_cores_busy"] - e["cores_busy"] for e in watched
                      if e.get("machine_cores_busy") is not None and e.get("cores_busy") is not None])
    cores = os.cpu_count() or 1
    if others is not None and others > max(1.0, SHARED * cores):
        warnings.append(f"other processes kept about {others:.1f} of the machine's {cores} cores busy while it ran: "
                        "these figures are what a shared machine gave; run again on a quiet one to compare")
    rss_peaks = [e["rss_peak"] for e in epochs if e["rss_peak"] is not None]
    detail = describe(name, stats, workers)
    return {
        "name": name,
        "pipeline": name if stats is None else f"{name} ({detail})",
        "detail": detail,
        "loader_stats": stats,
        "epochs": epochs,
        "images_per_s": rate,
        "monitored_images_per_s": watched_rate,
        "bench_overhead": overhead,
        "plain_spread": spread,
        "warnings": warnings,
        "first_epoch_s": epochs[0]["seconds"],
        "steady_epoch_s": _median([e["seconds"] for e in epochs if e["kind"] == "plain"]),
        "gpu_busy": _median([e["gpu_busy"] for e in watched]),
        "cpu_cores_busy": _median([e["cores_busy"] for e in watched]),
        "peak_rss_bytes": max(rss_peaks) if rss_peaks else None,
        "added_rss_bytes": _added(rss_peaks, before["rss"]),
        "added_pss_bytes": _added([e["pss_peak"] for e in epochs if e["kind"] == "memory"], before["pss"]),
        "gpu_mem_before_loader_bytes": before["gpu_used"],
        "gpu_mem_added_bytes": _added([e["gpu_mem_peak"] for e in epochs], before["gpu_used"]),
    }


def ceiling_row(step: TrainStep, batch_size: int, device: torch.device, monitor: Monitor) -> dict[str, Any]:
    """The model's own rate on tensors already on the GPU, with GPU busy read while it runs."""
    monitor.start()
    rate = ceiling_rate(step, batch_size, device)
    reading = monitor.stop().get()
    return {"name": "ceiling", "pipeline": "GPU-resident tensors (ceiling)", "detail": CEILING,
            "images_per_s": rate, "gpu_busy": reading.gpu_busy, "cpu_cores_busy": reading.cores_busy, "epochs": [],
            "warnings": []}
