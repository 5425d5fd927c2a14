"""What the loader's work on the GPU costs the training: a model trains on GPU-resident batches while a
loader runs beside it in the same process, paced at a fixed rate, and the device time of the loader's own
kernels and copies per image, by stage.

    python3 benchmarks/paced.py DATA [--model resnet18] [--rate 12000] [--decodes auto,cpu] [--seconds 8]

1. The model alone: images/s on one batch already on the GPU (bf16, channels_last, SGD, as `gpufeed bench`).
2. For each decode mode: the model again while an ImageLoader runs in a thread of this process, taking a
   batch no faster than ``--rate`` images/s (each batch read once on the device, as training would read it).
   "of alone" is the training's rate beside the loader over its rate alone; the loader's delivered rate is
   printed too (a loader that cannot keep the pace costs less than one that can).
3. For each decode mode, with ``--profile`` batches: the loader alone at full speed under torch.profiler, in
   a child process (where CUPTI cannot trace, the profiler may crash the process: the tables above are printed
   first); each CUDA kernel and copy's device time, summed by stage (engine decode, crop-resize kernel, copies
   to the device, other), per image.

The model alone is measured again at the end; the spread of the two is the run's noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch

from gpufeed import ImageLoader
from gpufeed.bench.run import machine_description
from gpufeed.bench.train import make_train_step, model_rate


class PacedLoader(threading.Thread):
    """Iterates ``loader`` epoch after epoch, at most ``rate`` images/s, until stopped; counts what it got."""

    def __init__(self, loader: ImageLoader, rate: float) -> None:
        super().__init__(daemon=True)
        self.loader, self.rate = loader, rate
        self.stop = threading.Event()
        self.images, self.error = 0, None
        self.window: tuple[float, int] | None = None

    def run(self) -> None:
        try:
            t0, n = time.perf_counter(), 0
            while not self.stop.is_set():
                for images, _ in self.loader:
                    images.float().sum()  # read on the device once, as the training would
                    n += images.shape[0]
                    self.images = n
                    ahead = t0 + n / self.rate - time.perf_counter()
                    if ahead > 0:
                        time.sleep(ahead)
                    if self.stop.is_set():
                        break
        except Exception as e:  # reported by the main thread
            self.error = e

    def mark(self) -> tuple[float, int]:
        return time.perf_counter(), self.images


def make_loader(args: argparse.Namespace, decode: str) -> ImageLoader:
    return ImageLoader(args.data, batch_size=args.batch_size, device="cuda", decode=decode,
                       num_workers=args.workers or None, channels_last=True, seed=0)


def beside(args, step, images, labels, decode: str) -> tuple[float, float]:
    """(training images/s, loader images/s) while a paced loader runs beside the training."""
    loader = make_loader(args, decode)
    runner = PacedLoader(loader, args.rate)
    runner.start()
    while runner.images < 4 * args.batch_size and runner.error is None:  # started and warm
        time.sleep(0.05)
    t0, n0 = runner.mark()
    rate = model_rate(step, images, labels, args.seconds)
    t1, n1 = runner.mark()
    runner.stop.set()
    runner.join()
    loader.close()
    if runner.error is not None:
        raise runner.error
    return rate, (n1 - n0) / (t1 - t0)


def stage_of(name: str) -> str:
    low = name.lower()
    if "memcpy" in low:
        return "copies " + ("to the device" if "htod" in low else "on the device" if "dtod" in low else "to the host")
    if "memset" in low:
        return "memset"
    if "resized_crop" in low:
        return "crop-resize-normalise kernel"
    if "jpeg" in low or "decode" in low or "idct" in low or "huffman" in low:
        return "JPEG decode (SM kernels)"
    return "other kernels"


def profile(args, decode: str) -> dict[str, tuple[float, int]] | str:
    """{stage: (device microseconds per image, kernel count)} over ``args.profile`` batches of the loader alone,
    or why the profiler could not see the device."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    loader = make_loader(args, decode)
    try:
        batches = iter(_endless(loader))
        for _ in range(8):  # started and warm
            next(batches)[0].float().sum()
        torch.cuda.synchronize()
        n = 0
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profile):
                images = next(batches)[0]
                images.float().sum()
                n += images.shape[0]
            torch.cuda.synchronize()
    finally:
        loader.close()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            stage = stage_of(e.name)
            totals[stage] += e.time_range.elapsed_us()
            counts[stage] += 1
    if not totals:
        return "the profiler recorded no device activity here (CUPTI unavailable)"
    top = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            top[e.name[:70]] += e.time_range.elapsed_us()
    print(f"  decode={decode}: the 8 longest kernels and copies over {n} images (us per image)")
    for name, us in sorted(top.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {us / n:8.2f}  {name}")
    return {k: (v / n, counts[k]) for k, v in totals.items()}


def profile_in_child(args: argparse.Namespace, decode: str) -> dict[str, tuple[float, int]] | str:
    """``profile`` in a child process: its result, or how the child ended."""
    import json
    import subprocess

    cmd = [sys.executable, __file__, args.data, "--profile", str(args.profile), "--batch-size", str(args.batch_size),
           "--workers", str(args.workers), "--profile-only", decode]
    done = subprocess.run(cmd, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("  "):
            print(line)
    result = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not result:
        return f"the profiler's process ended with {done.returncode}"
    found = json.loads(result[0])
    return found if isinstance(found, str) else {k: tuple(v) for k, v in found.items()}


def _endless(loader: ImageLoader):
    while True:
        yield from loader


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--rate", type=float, default=12_000, help="the loader's pace, images/s")
    p.add_argument("--decodes", default="auto,cpu", help="comma-separated ImageLoader decode= values")
    p.add_argument("--seconds", type=float, default=8.0, help="seconds per training measurement")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=0, help="0: the loader's default")
    p.add_argument("--profile", type=int, default=30, help="batches profiled per decode mode (0: none)")
    p.add_argument("--profile-only", metavar="DECODE", help=argparse.SUPPRESS)  # the child of profile_in_child
    args = p.parse_args()
    if args.profile_only:
        import json

        print("RESULT " + json.dumps(profile(args, args.profile_only)))
        return 0
    if not torch.cuda.is_available():
        print("paced.py needs a CUDA GPU: it measures what the loader costs a training GPU")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"machine: {machine_description()}\ncommand: {' '.join(sys.argv)}")
    step = make_train_step(args.model, device)
    images = torch.randn(args.batch_size, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    model_rate(step, images, labels, 2.0)  # warm-up
    alone = [model_rate(step, images, labels, args.seconds)]
    rows = []
    for decode in args.decodes.split(","):
        train, delivered = beside(args, step, images, labels, decode)
        rows.append((decode, train, delivered))
    alone.append(model_rate(step, images, labels, args.seconds))
    base = statistics.mean(alone)
    print(f"\n{args.model} alone: {alone[0]:,.0f} and {alone[1]:,.0f} images/s (start, end)")
    print(f"| beside the training (loader paced at {args.rate:,.0f}/s, in a thread) | {args.model} images/s "
          "| of alone | loader images/s |\n|---|---|---|---|", flush=True)
    for decode, train, delivered in rows:
        print(f"| gpufeed decode={decode} | {train:,.0f} | {100 * train / base:.1f}% | {delivered:,.0f} |", flush=True)
    if not args.profile:
        return 0
    costs = {d: profile_in_child(args, d) for d in args.decodes.split(",")}
    stages = sorted({s for c in costs.values() if isinstance(c, dict) for s in c})
    print("\n| device time per image, loader alone (us) | " + " | ".join(costs) + " |")
    print("|---|" + "---|" * len(costs))
    for s in stages + ["total"]:
        cells = []
        for c in costs.values():
            if isinstance(c, str):
                cells.append(c)
            elif s == "total":
                cells.append(f"{sum(v for v, _ in c.values()):.1f}")
            else:
                cells.append(f"{c[s][0]:.1f} ({c[s][1]} launches)" if s in c else "-")
        print(f"| {s} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
