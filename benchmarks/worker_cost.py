"""Worker CPU per sample through a real WorkerPool (no GPU needed): what a worker process spends per image.

    python3 benchmarks/worker_cost.py DATA_DIR [--workers 1] [--share 0,0.25] [--cpu] [--epochs 3]
        [--batches 7] [--inflight 1] [--nice N]

Per configuration: one WorkerPool as the loader makes it (the GPU path: JPEG bytes and crop boxes out,
``--share`` of each batch decoded on the CPU down to its crop's rows; ``--cpu``: also the CPU path, pixels
out), batches of 256 over the first ``--batches`` x 256 files, one warm-up epoch, then ``--epochs`` epochs.
Reported per image: the workers' CPU time (user + system, from /proc), wall time, minor page faults and
context switches (all threads; the workers' main threads apart). Nothing else runs, so one worker
measures its own cost. Prints the machine and the command, then the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from gpufeed.augment.params import AugmentSpec
from gpufeed.placement import GPU_BYTES_CAPACITY, gpu_memory
from gpufeed.sources import folder_source
from gpufeed.workers import PipelineSpec, WorkerPool

BATCH = 256


def measure(data: str, num_workers: int, share: float, gpu_path: bool, epochs: int, batches: int,
            inflight: int = 1, nice: int | None = None) -> str:
    source = folder_source(data)
    if len(source) < batches * BATCH:
        raise SystemExit(f"{data} has {len(source)} files; this needs {batches * BATCH}")
    memory = gpu_memory(batch_size=BATCH, image_size=224, itemsize=4, prefetch_depth=2, gpu_decoders=int(gpu_path))
    spec = PipelineSpec(source, AugmentSpec(), 10**8, gpu_bytes_capacity=GPU_BYTES_CAPACITY if gpu_path else 0,
                        gpu_buffer_bytes=memory.buffer_bytes)
    slots = 4
    pool = WorkerPool(spec, num_workers=num_workers, num_slots=slots, batch_size=BATCH)
    if nice is not None:
        for pid in pool.pids:
            os.setpriority(os.PRIO_PROCESS, pid, nice)
    try:
        def epoch(e: int) -> None:  # ``inflight`` batches with the workers at a time, as the loader keeps slots
            submit = lambda b: pool.submit(b, b % slots, 0, e, list(range(b * BATCH, (b + 1) * BATCH)),
                                           cpu_rows=round(share * BATCH))
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
        n = epochs * batches * BATCH
        wall = (time.perf_counter() - t0) / n
        user, system, faults, switches, main_switches = (counts() - c0) / n
    finally:
        pool.close()
    path = "CPU path" if not gpu_path else f"GPU path, CPU share {share:g}"
    path += f", {inflight} in flight" + (f", nice {nice}" if nice is not None else "")
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--share", default="0,0.25", help="comma-separated CPU shares (GPU path)")
    p.add_argument("--cpu", action="store_true", help="also the CPU path (pixels out)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batches", type=int, default=7, help="batches of 256 per epoch")
    p.add_argument("--inflight", type=int, default=1, help="batches with the workers at a time (at most 4)")
    p.add_argument("--nice", type=int, help="the workers' nice value (default: the pool's own)")
    args = p.parse_args(argv)
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; python3 benchmarks/worker_cost.py "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}")
    print("| path | workers | worker CPU us/image (system) | wall us/image | minor faults/image "
          "| context switches/image (main threads) |\n|---|---|---|---|---|---|")
    opts = dict(inflight=min(4, args.inflight), nice=args.nice)
    for share in (float(s) for s in args.share.split(",")):
        print(measure(args.data, args.workers, share, True, args.epochs, args.batches, **opts), flush=True)
    if args.cpu:
        print(measure(args.data, args.workers, 0.0, False, args.epochs, args.batches, **opts), flush=True)


if __name__ == "__main__":
    main()
