"""Do the GPU path's per-file worker steps slow down when many processes run them at once?

    python3 benchmarks/step_scaling.py DATA_DIR [--n 600] [--procs 1,4,13]

Per step and process count P: P processes (spawned, no WorkerPool, no queues) each run the steps over the
first ``--n`` files, once to warm up and then three times; printed: the median over processes of wall and
CPU time per file. Steps, cumulative: ``read_file``; + ``gpu_safe_jpeg`` (the structural check); + copying
the bytes into a shared-memory block (as into the ring). If these scale and a WorkerPool of P workers does
not (``benchmarks/worker_cost.py --workers P``), the difference is the pool's own machinery.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing import shared_memory

import numpy as np

STEPS = ("read_file", "+ gpu_safe_jpeg", "+ copy into shared memory")
ROOM = 2 << 20  # bytes per process in the shared block


def _job(args) -> tuple[float, float]:
    from gpufeed.decode.jpeg_check import gpu_safe_jpeg
    from gpufeed.sources import folder_source
    from gpufeed.sources.base import read_file

    data, step, n, i, procs, shm_name = args
    source = folder_source(data)
    paths = [source.path(j) for j in range(min(n, len(source)))]
    shm = shared_memory.SharedMemory(name=shm_name)
    room = np.ndarray((procs, ROOM), np.uint8, shm.buf)

    def once() -> None:
        for p in paths:
            b = read_file(p)
            if step >= 1:
                gpu_safe_jpeg(b)
            if step >= 2:
                room[i, : len(b)] = np.frombuffer(b, np.uint8)

    try:
        once()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(3):
            once()
        return (time.perf_counter() - t0) / (3 * len(paths)), (time.process_time() - c0) / (3 * len(paths))
    finally:
        room = None  # the view goes before the block closes
        shm.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--n", type=int, default=600)
    p.add_argument("--procs", default="1,4,13")
    args = p.parse_args()
    counts = [int(x) for x in args.procs.split(",")]
    shm = shared_memory.SharedMemory(create=True, size=max(counts) * ROOM)
    try:
        print("| step | processes | wall us/file | CPU us/file |\n|---|---|---|---|")
        for step, name in enumerate(STEPS):
            for procs in counts:
                with mp.get_context("spawn").Pool(procs) as pool:
                    res = pool.map(_job, [(args.data, step, args.n, i, procs, shm.name) for i in range(procs)])
                wall, cpu = (statistics.median(r[k] for r in res) for k in (0, 1))
                print(f"| {name} | {procs} | {1e6 * wall:.0f} | {1e6 * cpu:.0f} |", flush=True)
    finally:
        shm.close()
        shm.unlink()


if __name__ == "__main__":
    main()
