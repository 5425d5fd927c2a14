"""Where a training step's time goes beside the loader: per epoch, how long the training thread waited for each
batch, how long its own step call took, and the CPU time of every thread of the training process and of the
worker processes, per step.

    python3 benchmarks/anatomy.py DATA [--model resnet18] [--cpu-share auto|F] [--epochs 5] [--json OUT]
        [--ctx-sched default|spin|yield|blocking]

The loop is the plain loop's (``plain_loop.py``), with two clocks read around ``next()`` and ``step()``;
every wait over 5 ms is listed with its step. Threads are named by Python's ``threading`` (their
``native_id``) and read from ``/proc/self/task`` at each epoch's ends, so a thread that lives within one
epoch (the prefetch thread, made per iteration) is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import torch

from plain_loop import ceiling, make_step

from gpufeed import ImageLoader

TICK = os.sysconf("SC_CLK_TCK")
CTX_SCHED = {"spin": 1, "yield": 2, "blocking": 4}


def set_ctx_sched(kind: str) -> int:
    """Set the current CUDA context's scheduling flag; the flags it has then."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    status = lib.cuCtxSetFlags(ctypes.c_uint(CTX_SCHED[kind]))
    if status != 0:
        raise RuntimeError(f"cuCtxSetFlags({kind}) returned {status}")
    flags = ctypes.c_uint()
    lib.cuCtxGetFlags(ctypes.byref(flags))
    return flags.value


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by its Python name (the native id where Python has none)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(tid), "native")
        out[name.split("_")[0] if name.startswith("gpufeed-decode") else name] += (int(fields[11]) + int(fields[12])) / TICK
    return out


class Timeline:
    """The prefetch thread's intervals, by state, recorded by wrapping the loader's functions."""

    def __init__(self) -> None:
        from gpufeed import transfer
        from gpufeed.stage.gpu import GpuDecodeAugment

        self.spans: list[tuple[str, float, float]] = []
        self._idle_from: float | None = None
        clock = time.perf_counter

        def timed(state, fn, after=None):
            def wrapper(*a, **k):
                t0 = clock()
                try:
                    return fn(*a, **k)
                finally:
                    t1 = clock()
                    self.spans.append((state, t0, t1))
                    if after:
                        after(t0, t1)
            return wrapper

        start, finish, put = transfer.Prefetcher._start, transfer.Prefetcher._finish, transfer._put

        def start_wrapper(*a, **k):
            t0 = clock()
            if self._idle_from is not None:
                self.spans.append(("workers", self._idle_from, t0))
            try:
                return start(*a, **k)
            finally:
                self.spans.append(("start", t0, clock()))

        def put_done(t0, t1):
            self._idle_from = t1

        transfer.Prefetcher._start = start_wrapper
        transfer.Prefetcher._finish = timed("finish", finish)
        transfer._put = timed("queue full", put, put_done)
        GpuDecodeAugment._await_decode = timed("decoders", GpuDecodeAugment._await_decode)
        try:  # the engine calls themselves, in the decoder threads (two may overlap a window)
            from gpufeed.decode.nvjpeg_hw import NvJpegHwDecoder

            NvJpegHwDecoder.decode = timed("engine calls", NvJpegHwDecoder.decode)
        except ImportError:
            pass

    def calls(self) -> str:
        """The engine calls' wall time: count, median and largest, ms."""
        d = sorted(1e3 * (t1 - t0) for s, t0, t1 in self.spans if s == "engine calls")
        return f"{len(d)} engine calls, median {d[len(d) // 2]:.1f} ms, max {d[-1]:.1f} ms" if d else "no engine calls"

    def during(self, windows: list[tuple[float, float]]) -> dict[str, float]:
        """ms of each state within ``windows``; "finish" less its "decoders" part."""
        out: dict[str, float] = defaultdict(float)
        for state, s0, s1 in self.spans:
            for a, b in windows:
                overlap = min(s1, b) - max(s0, a)
                if overlap > 0:
                    out[state] += 1e3 * overlap
        out["finish"] -= out.get("decoders", 0.0)
        return {k: round(v, 1) for k, v in out.items()}


def workers_cpu() -> float:
    total = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            t = c.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--cpu-share", default="auto")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--json")
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--ctx-sched", default="default", choices=["default", *CTX_SCHED])
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("anatomy.py needs a CUDA GPU: it times a model's training steps beside the loader")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    share = args.cpu_share if args.cpu_share == "auto" else float(args.cpu_share)
    timeline = Timeline() if args.timeline else None
    step = make_step(args.model, device, False)
    flags = set_ctx_sched(args.ctx_sched) if args.ctx_sched != "default" else None
    own = ceiling(step, args.batch_size, device, 2.0)
    result = {"model": args.model, "cpu_share_setting": args.cpu_share, "ceiling": own, "ctx_sched": args.ctx_sched,
              "ctx_flags": flags, "epochs": []}
    with ImageLoader(args.data, batch_size=args.batch_size, device=device, channels_last=True,
                     cpu_share=share) as loader:
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            threads0, workers0 = thread_cpu(), workers_cpu()
            waits, calls, n, steps, windows = [], [], 0, 0, []
            t0 = time.perf_counter()
            it = iter(loader)
            while True:
                a = time.perf_counter()
                try:
                    images, labels = next(it)
                except StopIteration:
                    break
                b = time.perf_counter()
                step(images, labels)
                c = time.perf_counter()
                waits.append(b - a)
                if steps and b - a > 0.005:
                    windows.append((a, b))
                calls.append(c - b)
                n += images.shape[0]
                steps += 1
            torch.cuda.synchronize(device)
            wall = time.perf_counter() - t0
            threads1, workers1 = thread_cpu(), workers_cpu()
            per = {k: 1e3 * (threads1.get(k, 0) - threads0.get(k, 0)) / steps for k in threads1}
            row = {"images_per_s": n / wall, "of_ceiling": n / wall / own, "wall_ms_per_step": 1e3 * wall / steps,
                   "wait_ms": 1e3 * statistics.mean(waits), "wait_ms_median": 1e3 * statistics.median(waits),
                   "first_wait_ms": 1e3 * waits[0], "long_waits_ms": [round(1e3 * w, 1) for w in waits[1:] if w > 0.005],
                   "long_wait_at": [i for i, w in enumerate(waits) if i and w > 0.005],
                   "step_call_ms": 1e3 * statistics.mean(calls),
                   "thread_cpu_ms_per_step": {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])
                                              if v >= 0.05},
                   "workers_cores_busy": (workers1 - workers0) / wall,
                   "cpu_share": loader.stats.get("cpu_share")}
            if timeline is not None:
                row["prefetch_thread_in_long_waits_ms"] = timeline.during(windows)
                row["engine_calls"] = timeline.calls()
                timeline.spans.clear()
            result["epochs"].append(row)
            print(f"epoch {epoch}: {row['images_per_s']:,.0f} images/s ({100 * row['of_ceiling']:.1f}%), "
                  f"{row['wall_ms_per_step']:.1f} ms a step: waited {row['wait_ms']:.1f} (median "
                  f"{row['wait_ms_median']:.1f}; first {row['first_wait_ms']:.0f}; over 5 ms at {row['long_wait_at']}: "
                  f"{row['long_waits_ms']}), step call {row['step_call_ms']:.1f}; share {row['cpu_share']}; "
                  f"workers {row['workers_cores_busy']:.1f} cores; threads ms/step "
                  + ", ".join(f"{k} {v}" for k, v in row["thread_cpu_ms_per_step"].items()), flush=True)
            if timeline is not None:
                print(f"  prefetch thread during the waits over 5 ms (ms): {row['prefetch_thread_in_long_waits_ms']}; "
                      f"{row['engine_calls']}",
                      flush=True)
        result["decoded_by"] = dict(loader.stats.get("decoded_by") or {})
    rest = result["epochs"][1:]
    result["images_per_s"] = statistics.median(r["images_per_s"] for r in rest)
    print(f"{args.model} share {args.cpu_share} sched {args.ctx_sched} (flags {flags}): own rate {own:,.0f}; median "
          f"{result['images_per_s']:,.0f} ({100 * result['images_per_s'] / own:.1f}%); {result['decoded_by']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
