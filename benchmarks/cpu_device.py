"""Where a CPU device's loader spends its main process, per batch: waiting for the workers' batches, and
making the batch handed out (the workers normalised it: a copy out of the shared ring, split over
``torch.get_num_threads()`` threads).

    python3 benchmarks/cpu_device.py DATA_DIR [--workers N] [--batch-size 256] [--epochs 3]

Loader only, ``device="cpu"``; the first epoch is warm-up. Prints images/s over the later epochs, the
milliseconds per batch in each part, how many distinct output arrays the batches used (few: they are
reused; one per batch: each new one is paged in by the kernel), and the threads used.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from gpufeed import ImageLoader
from gpufeed import loader as loader_module


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args(argv)
    spent = {"make": 0.0}
    original = loader_module._Normalized.__call__

    def timed(self, batch):
        t0 = time.perf_counter()
        out = original(self, batch)
        spent["make"] += time.perf_counter() - t0
        return out

    loader_module._Normalized.__call__ = timed  # the loader's own step, timed
    loader = ImageLoader(args.data, batch_size=args.batch_size, device="cpu", num_workers=args.workers)
    try:
        for _ in loader:  # warm-up epoch: workers started, arrays made
            pass
        spent["make"], batches, arrays = 0.0, 0, set()
        t0 = time.perf_counter()
        for _ in range(args.epochs - 1):
            for images, _labels in loader:
                batches += 1
                arrays.add(images.data_ptr())
        wall = time.perf_counter() - t0
    finally:
        loader_module._Normalized.__call__ = original
        loader.close()
    n = batches * args.batch_size
    print(f"{time.strftime('%Y-%m-%d')}, {len(os.sched_getaffinity(0))} CPUs, torch threads "
          f"{torch.get_num_threads()}; python3 benchmarks/cpu_device.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print("| images/s | ms per batch | making the batch, ms | the rest (waiting for workers), ms | distinct output arrays |")
    print("|---|---|---|---|---|")
    per = 1000 * wall / max(batches, 1)
    norm = 1000 * spent["make"] / max(batches, 1)
    print(f"| {n / wall:,.0f} | {per:.1f} | {norm:.1f} | {per - norm:.1f} | {len(arrays)} of {batches} batches |")


if __name__ == "__main__":
    main()
