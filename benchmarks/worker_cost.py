"""Worker CPU per sample through a real WorkerPool (no GPU needed): what a worker process spends per image.

    python3 benchmarks/worker_cost.py DATA_DIR [--workers 1] [--share 0,0.25] [--cpu] [--epochs 3] [--profile N]
        [--map-bytes B,...] [--rows 1,0]

Per configuration: one WorkerPool (as the loader makes it; ``--cpu``: the CPU path, pixels out; otherwise
the GPU path, JPEG bytes and crop boxes out, ``--share`` of each batch decoded on the CPU), batches of 256
over the first 7 x 256 files, one warm-up epoch, then ``--epochs`` epochs; reported: the workers' CPU time
from /proc per image, and wall time per image. Nothing else runs, so one worker measures its own cost.
``--map-bytes``: each configuration with each value of ``workers.RING_MAP_BYTES`` (bytes of each arena
position mapped ahead; 0: none). ``--rows``: each share with the CPU's crops left as rows for the GPU to
resize (1, the default) and/or resized by the worker (0). ``--profile N``: also the worker's GPU-path code at the first share run in this process under cProfile
(``_serve_chunk`` over the same batches, chunks of 8), its N most expensive functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import os
import pstats
import time

import numpy as np

import gpufeed.workers as workers
from gpufeed.augment.params import AugmentSpec
from gpufeed.loader import GPU_BYTES_CAPACITY
from gpufeed.sources import folder_source


def measure(data: str, num_workers: int, share: float, gpu_path: bool, epochs: int, batches: int = 7,
            inflight: int = 1, nice: int | None = None, chunk: int | None = None, rows: bool = True) -> str:
    source = folder_source(data)
    if len(source) < batches * 256:
        raise SystemExit(f"{data} has {len(source)} files; this needs {batches * 256}")
    spec = workers.PipelineSpec(source, AugmentSpec(), 10**8, gpu_bytes_capacity=GPU_BYTES_CAPACITY if gpu_path else 0,
                                rows_to_gpu=rows)
    pool = workers.WorkerPool(spec, num_workers=num_workers, num_slots=4, batch_size=256)
    if chunk:
        pool._chunk = chunk
    if nice is not None:
        for pid in pool.pids:
            os.setpriority(os.PRIO_PROCESS, pid, nice)
    try:
        def epoch(e: int) -> None:  # ``inflight`` batches with the workers at a time, as the loader keeps slots
            submit = lambda b: pool.submit(b, b % 4, 0, e, list(range(b * 256, (b + 1) * 256)),
                                           cpu_rows=round(share * 256))
            for b in range(min(inflight, batches)):
                submit(b)
            for b in range(batches):
                pool.collect(b)
                if b + inflight < batches:
                    submit(b + inflight)

        epoch(0)
        counts = lambda: np.sum([_counters(p) for p in pool.pids], axis=0)
        c0, t0 = counts(), time.perf_counter()
        for e in range(1, epochs + 1):
            epoch(e)
        n = epochs * batches * 256
        wall = (time.perf_counter() - t0) / n
        user, system, faults, switches, main_switches = (counts() - c0) / n
    finally:
        pool.close()
    path = "CPU path" if not gpu_path else f"GPU path, CPU share {share:g}" + ("" if rows else " resized here")
    path += f", {workers.RING_MAP_BYTES >> 10} KB mapped ahead, {inflight} in flight"
    path += "".join(f", {k} {v}" for k, v in (("nice", nice), ("chunk", chunk)) if v is not None)
    return (f"| {path} | {num_workers} | {1e6 * (user + system):,.0f} ({1e6 * system:,.0f}) | {1e6 * wall:,.0f} | "
            f"{faults:,.1f} | {switches:,.2f} ({main_switches:,.2f}) |")


def _counters(pid: int) -> np.ndarray:
    """A process's user and system CPU seconds, minor page faults, context switches (all threads) and its
    main thread's context switches so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    switches = main = 0
    for task in os.listdir(f"/proc/{pid}/task"):  # all threads (the queue's feeder thread too)
        with open(f"/proc/{pid}/task/{task}/status") as f:
            n = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        switches += n
        main += n if int(task) == pid else 0
    return np.array([int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7]), switches, main], np.float64)


def profile(data: str, share: float, top: int, batches: int = 7) -> None:
    """``_serve_chunk`` in this process, as a worker runs it, under cProfile: the ``top`` functions by own time."""
    from multiprocessing import shared_memory

    from gpufeed.decode.cpu import CpuDecoder
    from gpufeed.ring import Ring

    workers._keep_heap()
    spec = workers.PipelineSpec(folder_source(data), AugmentSpec(), 10**8, gpu_bytes_capacity=GPU_BYTES_CAPACITY)
    shm = shared_memory.SharedMemory(create=True, size=Ring.nbytes(1, 256, 224, GPU_BYTES_CAPACITY))
    try:
        ring, decoder, mine = Ring(shm, 1, 256, 224, GPU_BYTES_CAPACITY), CpuDecoder(), mp.Array("d", 4)

        def epoch(e: int) -> None:
            for b in range(batches):
                for c in range(0, 256, 8):
                    workers._serve_chunk(spec, decoder, ring, mine, b, c, 0, 0, e, c,
                                         list(range(b * 256 + c, b * 256 + c + 8)), round(share * 8))

        epoch(0)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(epoch, 1)
        print(f"\nin-process, CPU share {share:g}: {1e6 * (time.perf_counter() - t0) / (batches * 256):.0f} us "
              "per image under the profiler")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)
        ring = None  # its views of the block go before the block closes
    finally:
        shm.close()
        shm.unlink()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--share", default="0,0.25", help="comma-separated CPU shares (GPU path)")
    p.add_argument("--cpu", action="store_true", help="also the CPU path (pixels out)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--map-bytes", default=str(workers.RING_MAP_BYTES))
    p.add_argument("--inflight", type=int, default=1, help="batches with the workers at a time (at most 4)")
    p.add_argument("--nice", type=int, help="the workers' nice value (default: the pool's own)")
    p.add_argument("--chunk", type=int, help="samples per task (default: the pool's own)")
    p.add_argument("--rows", default="1", help="comma-separated: 1, the CPU share's rows go to the GPU; 0, resized here")
    args = p.parse_args()
    print("| path | workers | worker CPU us/image (system) | wall us/image | minor faults/image "
          "| context switches/image (main threads) |"
          "\n|---|---|---|---|---|---|")
    opts = dict(inflight=min(4, args.inflight), nice=args.nice, chunk=args.chunk)
    for workers.RING_MAP_BYTES in (int(b) for b in args.map_bytes.split(",")):
        for share in (float(s) for s in args.share.split(",")):
            for rows in (r == "1" for r in args.rows.split(",")):
                print(measure(args.data, args.workers, share, True, args.epochs, rows=rows, **opts), flush=True)
        if args.cpu:
            print(measure(args.data, args.workers, 0.0, False, args.epochs, **opts), flush=True)
    if args.profile:
        profile(args.data, float(args.share.split(",")[0]), args.profile)


if __name__ == "__main__":
    main()
