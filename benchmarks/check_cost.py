"""What the bad-input checks cost on clean data: per-sample worker time with and without them.

    python3 benchmarks/check_cost.py DATA_DIR [--n 400] [--rounds 5]

The checks that run for every clean sample are the structural JPEG test (``gpu_safe_jpeg``: on the CPU
path before a cropped decode, on the GPU path before a file may go to a GPU decoder) and the header's
pixel cap; strict decoding is a flag of the same decode call and costs nothing. This times, in one
process and interleaved round by round, the workers' per-sample function of each path
(``load_sample_into``: read, decode, crop, resize; ``encode_sample_into``: read, header, box, bytes into
the ring) as shipped and with the structural test replaced by "pass". On the CPU path the loader is
bound by exactly this work, so the ratio is the throughput cost; on the GPU path it is the workers' part.
"""

from __future__ import annotations

import argparse
import statistics
import time
from multiprocessing import shared_memory

import numpy as np

import gpufeed.decode.cpu as cpu_mod
import gpufeed.workers as workers
from gpufeed.augment.params import AugmentSpec
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.ring import Ring
from gpufeed.sources import folder_source


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    src = folder_source(args.data)
    n = min(args.n, len(src))
    cpu_spec = workers.PipelineSpec(src, AugmentSpec(), 10**8)
    gpu_spec = workers.PipelineSpec(src, AugmentSpec(), 10**8, gpu_bytes_capacity=2 << 20)
    dec = CpuDecoder()
    out = np.empty((224, 224, 3), np.uint8)
    shm = shared_memory.SharedMemory(create=True, size=Ring.nbytes(1, n, 224, 2 << 20))
    ring = Ring(shm, 1, n, 224, 2 << 20)
    checked = (workers.gpu_safe_jpeg, cpu_mod.gpu_safe_jpeg)

    def set_checks(on: bool) -> None:
        workers.gpu_safe_jpeg, cpu_mod.gpu_safe_jpeg = checked if on else (lambda d: True, lambda d: True)

    def cpu_path() -> float:
        t0 = time.perf_counter()
        for i in range(n):
            workers.load_sample_into(cpu_spec, dec, 0, 0, i, out)
        return (time.perf_counter() - t0) / n

    def gpu_path() -> float:
        t0 = time.perf_counter()
        for i in range(n):
            workers.encode_sample_into(gpu_spec, dec, 0, 0, i, ring, 0, i)
        return (time.perf_counter() - t0) / n

    times = {(path, on): [] for path in ("cpu", "gpu") for on in (True, False)}
    for path, fn in (("cpu", cpu_path), ("gpu", gpu_path)):
        set_checks(True)
        fn()  # warm-up: page cache, allocations
        for _ in range(args.rounds):
            for on in (True, False):
                set_checks(on)
                times[(path, on)].append(fn())
    set_checks(True)
    ring = None  # drop the views before the block is closed
    shm.close()
    shm.unlink()
    print(f"{n} files from {args.data}, {args.rounds} interleaved rounds, median per-sample time")
    print("| worker path | with checks | without | cost of the checks |\n|---|---|---|---|")
    for path, label in (("cpu", "CPU decode (load_sample_into)"), ("gpu", "GPU path (encode_sample_into)")):
        on, off = statistics.median(times[(path, True)]), statistics.median(times[(path, False)])
        print(f"| {label} | {on * 1e6:.0f} us | {off * 1e6:.0f} us | {100 * (on / off - 1):+.1f}% |")


if __name__ == "__main__":
    main()
