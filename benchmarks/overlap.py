"""Does gpufeed.prefetch overlap host-to-device copies with compute? Times copies alone, compute alone and
both through ``prefetch`` on CUDA events.

    python3 benchmarks/overlap.py [--batches 8] [--mb 64]

Prints copy ms, compute ms, both ms and the hidden share of the shorter one ((copy + compute - both) /
min(copy, compute)): 0 means serial, 1 fully overlapped. Needs CUDA; elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from gpufeed import prefetch


def measure(batches: int, mb: int) -> tuple[float, float, float]:
    host = [torch.randn((mb << 20) // 4).pin_memory() for _ in range(batches)]
    a = torch.randn(4096, 4096, device="cuda")

    def work() -> None:
        for _ in range(6):
            a @ a

    def timed(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    timed(lambda: [work() for _ in host])  # warm-up: kernels, handles
    copy_ms = timed(lambda: [h.cuda(non_blocking=True) for h in host])
    work_ms = timed(lambda: [work() for _ in host])
    both_ms = timed(lambda: [work() for _ in prefetch(host, "cuda", depth=2)])
    return copy_ms, work_ms, both_ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--mb", type=int, default=64, help="MB per batch")
    args = p.parse_args(argv)
    command = f"python3 benchmarks/overlap.py {' '.join(sys.argv[1:] if argv is None else argv)}"
    if not torch.cuda.is_available():
        print(f"{command}: needs CUDA (none here); nothing measured")
        return
    copy_ms, work_ms, both_ms = measure(args.batches, args.mb)
    hidden = (copy_ms + work_ms - both_ms) / min(copy_ms, work_ms)
    print(f"{time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch {torch.__version__}; {command}")
    print("| copies ms | compute ms | both through prefetch ms | hidden share of the shorter |\n|---|---|---|---|")
    print(f"| {copy_ms:.1f} | {work_ms:.1f} | {both_ms:.1f} | {hidden:.2f} |")


if __name__ == "__main__":
    main()
