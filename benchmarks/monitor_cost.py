"""What each of `gpufeed bench`'s monitors costs the run it measures, alternating epoch by epoch in one process.

    python benchmarks/monitor_cost.py DATA [--models none,resnet18] [--rounds 3] [--device cuda]

One ImageLoader per model (a warm-up epoch first); then, each round, one epoch under each variant in turn:
- plain: ``for images, labels in loader: step(images, labels)``, nothing else in the process;
- sampler: the bench's monitored epoch (NVML utilisation and memory every 50 ms, the tree's RSS every 200 ms,
  CPU time at the ends, all read by ``gpufeed.bench.monitor``'s sampler process); sampler-nvml and
  sampler-rss: each part alone;
- pss: the bench's memory epoch (the sampler, plus the tree's PSS read once halfway);
- thread: the same readings as the sampler, taken by a thread of the measured process;
- bar: a tqdm bar moved every batch (written to /dev/null, as to a terminal);
- sum (loader only): each batch read once on the device (``images.sum()``).
Prints, per model, each variant's median images/s, its spread, and its cost against plain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from gpufeed import ImageLoader
from gpufeed.bench.monitor import Monitor
from gpufeed.bench.run import machine_description
from gpufeed.bench.train import make_train_step


class _ThreadSampler:
    """The sampler's readings from a thread of this process: NVML every 50 ms, the tree's RSS every 200 ms."""

    def __init__(self, gpu_index: int | None) -> None:
        import psutil

        self.psutil, self.me = psutil, psutil.Process(os.getpid())
        self.nvml = self.handle = None
        if gpu_index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
            except Exception:
                pass
        self._stop = threading.Event()

    def _run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            if self.nvml is not None:
                self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
                self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
            if tick % 4 == 0:
                for p in [self.me, *self.me.children(recursive=True)]:
                    try:
                        p.memory_info()
                    except self.psutil.Error:
                        pass
            tick += 1
            time.sleep(0.05)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _epoch(loader, step, device, variant: str, monitors: dict) -> float:
    bar = None
    if variant == "bar":
        from tqdm import tqdm

        bar = tqdm(total=len(loader), file=open(os.devnull, "w"), mininterval=0.1)
    monitor = monitors.get(variant)
    halfway = max(1, len(loader) // 2)
    if monitor is not None:
        monitor.start()
    n, t0 = 0, time.perf_counter()
    for batch, (images, labels) in enumerate(loader, 1):
        if step is not None:
            step(images, labels)
        elif variant == "sum":
            images.sum()
        n += images.shape[0]
        if bar is not None:
            bar.update(1)
        if variant == "pss" and batch == halfway:
            monitor.read_pss()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rate = n / (time.perf_counter() - t0)
    if monitor is not None:  # after the clock: the sampler's closing read is not timed
        pending = monitor.stop()
        if pending is not None:  # the sampler process's readings (the thread's are not kept)
            pending.get()
    if bar is not None:
        bar.close()
    return rate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--models", default="none,resnet18")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gpu = device.index if device.type == "cuda" else None
    print(machine_description(), f"batch {args.batch_size}, {args.rounds} rounds")
    monitors = {"sampler": Monitor(gpu), "sampler-nvml": Monitor(gpu, what=("nvml",)),
                "sampler-rss": Monitor(gpu, what=("rss",)), "thread": _ThreadSampler(gpu)}
    monitors["pss"] = monitors["sampler"]
    for model in args.models.split(","):
        step = make_train_step(model, device) if model != "none" and device.type == "cuda" else None
        variants = ["plain", "sampler", "sampler-nvml", "sampler-rss", "pss", "thread", "bar"] + (
            ["sum"] if step is None else [])
        rates: dict[str, list[float]] = {v: [] for v in variants}
        with ImageLoader(args.data, batch_size=args.batch_size, device=device, num_workers=args.workers,
                         channels_last=step is not None) as loader:
            _epoch(loader, step, device, "plain", monitors)  # warm-up
            for r in range(args.rounds):
                order = variants if r % 2 == 0 else variants[::-1]  # drift within a round cancels over two
                for v in order:
                    rates[v].append(_epoch(loader, step, device, v, monitors))
            batches = len(loader)
        plain = statistics.median(rates["plain"])
        print(f"\nmodel {model}, {batches} batches an epoch, {len(rates['plain'])} epochs of each")
        print("| variant | images/s, median | spread (min-max) | cost against plain |\n|---|---|---|---|")
        for v in variants:
            med = statistics.median(rates[v])
            cost = "-" if v == "plain" else f"{100 * (plain / med - 1):+.1f}%"
            print(f"| {v} | {med:,.0f} | {min(rates[v]):,.0f}-{max(rates[v]):,.0f} | {cost} |")
    for m in {id(m): m for m in monitors.values() if isinstance(m, Monitor)}.values():
        m.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
