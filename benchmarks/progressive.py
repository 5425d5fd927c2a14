"""Progressive resizing: one loader made at the largest size, an epoch at each size through
``loader.set_image_size``, loader only.

    python3 benchmarks/progressive.py DATA_DIR [--sizes 160,192,224] [--device auto] [--decode auto]
                                      [--workers N] [--batch-size 256] [--warmup 1]

The loader is made at the largest of ``--sizes`` (its shared memory and GPU batches hold the smaller ones);
``--warmup`` epochs at the first size start the workers and decoders first. Prints, per epoch, the size,
images/s and seconds (on CUDA up to the last batch's work finished), then the worker processes' PIDs
before and after the sizes changed (the same processes: nothing restarts), the machine and the command.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from gpufeed import ImageLoader


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes takes integers separated by commas, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes needs at least one size >= 1, got {text!r}")
    return sizes


def _epoch(loader: ImageLoader, device: torch.device) -> tuple[int, float]:
    """Images and seconds of one epoch of the loader, batches dropped as they come."""
    n, t0 = 0, time.perf_counter()
    for images, _labels in loader:
        n += len(images)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data")
    p.add_argument("--sizes", type=_sizes, default=[160, 192, 224])
    p.add_argument("--device", default="auto")
    p.add_argument("--decode", default="auto")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    loader = ImageLoader(args.data, batch_size=args.batch_size, image_size=max(args.sizes), device=args.device,
                         decode=args.decode, num_workers=args.workers)
    rows = []
    try:
        loader.set_image_size(args.sizes[0])
        for _ in range(args.warmup):
            _epoch(loader, loader.device)
        before = loader.worker_pids
        for size in args.sizes:
            loader.set_image_size(size)
            epoch = loader.sampler.epoch
            n, seconds = _epoch(loader, loader.device)
            rows.append((epoch, size, n, seconds))
        after = loader.worker_pids
        backend = loader.decode_backend
    finally:
        loader.close()
    gpu = torch.cuda.get_device_name(loader.device) if loader.device.type == "cuda" else "no GPU"
    print(f"{time.strftime('%Y-%m-%d')}, {platform.node()}, {len(os.sched_getaffinity(0))} CPUs, {gpu}, "
          f"torch {torch.__version__}; device {loader.device}, decode {backend}, {loader.num_workers} workers, "
          f"batch {args.batch_size}, made at {max(args.sizes)}")
    print(f"python3 benchmarks/progressive.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print("| epoch | image size | images/s | seconds |")
    print("|---|---|---|---|")
    for epoch, size, n, seconds in rows:
        print(f"| {epoch} | {size} | {n / seconds:,.0f} | {seconds:.2f} |")
    same = "the same processes" if before == after else "CHANGED"
    print(f"worker PIDs before the sizes changed: {before}; after: {after} ({same})")


if __name__ == "__main__":
    main()
