"""Where the GPU path's loader-only throughput goes: worker count, CPU share, worker priority, decoders.

    python3 benchmarks/sweep_gpu_path.py DATA_DIR [--epochs 3] [CONFIG ...]

CONFIG is ``w<workers>,<share>,n<nice>[,d<decoders>][,s<ring slots>][,j<images per decode call>]
[,l<late threshold ms>][,i<idle cores kept>][,a<cores kept from workers>][,c<images per worker chunk>][,v<decode choice>]
[,r<region decode 0/1>][,p<CPU pick: ratio/cpu_cost>][,m<KB of each arena position mapped ahead>]
[,z<0: the CPU share resized by the workers; 1: its rows resized by the GPU kernel, the default>]
[,g<most steps down of the auto share per window (the loader's _ShareControl.MAX_DOWN_STEPS; g1: the rule before
session 8)>]``,
e.g. ``w16,auto,n5`` (the loader's defaults on a 16-core machine) or ``w12,0.3,n10,d1,s6,j64,vnvjpeg``;
d, s, j, l, c default to the loader's own settings, v to "gpu". ``a<k>`` keeps the workers off the first k usable cores (``sched_setaffinity``), leaving them to this
process's threads (decoder threads, prefetch thread); ``a0`` lets them use all; without it, the loader's own
choice (``ImageLoader.worker_cpus``). ``b1`` makes the CUDA context block in synchronisations instead of
spinning (``cuCtxSetFlags``), for that config and all after it. Also reported: the cores each thread of this
process kept busy (decoder threads grouped) and the workers together. Per config: one ImageLoader(decode="gpu", batch 256), one warm-up
epoch, then ``--epochs`` timed epochs (loader only: each batch reaches the device and is read once).
Reported: images/s (median epoch), images/s within epochs (from the second batch's arrival to the last's:
what an epoch boundary costs is left out), the CPU share at the end, the GPU stage's host time per batch (median;
``start`` + ``finish`` in the prefetch thread: layout, copies, waiting for the decoders, kernel launch),
the wait for the workers per batch (median), and the cores the process tree kept busy; per timed epoch, the
CPU share (mean over its batches) and the time this process spent in the garbage collector; then, per batch on
average: how long ``finish`` waited for the decoder threads, the decoders' library calls (nvImageCodec's
``decode()``, nvJPEG's batched call) and the rest of their ``decode_into``/``decode_packed`` (CodeStreams,
target wrapping, result checks), both summed over the decoder threads, and the stage's time outside the
wait. Worker priority is set on the running workers (``setpriority``).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import gc
import os
import statistics
import subprocess
import threading
import time

import torch

import gpufeed.workers as workers
from gpufeed import ImageLoader
from gpufeed.bench.monitor import Monitor
from gpufeed.decode.nvimgcodec import NvImageCodecDecoder
from gpufeed.decode.nvjpeg_hw import NvJpegHwDecoder
from gpufeed.decode.placement import create_gpu_decoder
from gpufeed.gpu_stage import GpuDecodeAugment

DEFAULT = ["w16,auto,n5", "w16,0.3,n5", "w16,0,n5", "w4,0,n5", "w16,auto,n5,l1", "w16,auto,n5", "w16,0.3,n5"]


def parse(config: str) -> dict:
    parts = config.split(",")
    out = {"workers": int(parts[0][1:]), "share": parts[1] if parts[1] == "auto" else float(parts[1]),
           "nice": int(parts[2][1:]), "decoders": 2, "slots": None, "job": None,
           "late_ms": None, "via": "gpu", "roi": None, "blocking": 0, "reserve": None, "kept": None, "chunk": None, "pick": None, "map_kb": None,
           "rows": None, "down": None}
    for extra in parts[3:]:
        key = {"d": "decoders", "s": "slots", "j": "job", "l": "late_ms", "v": "via", "r": "roi",
               "b": "blocking", "i": "reserve", "a": "kept", "c": "chunk", "p": "pick", "m": "map_kb",
               "z": "rows", "g": "down"}[extra[0]]
        out[key] = (extra[1:] if key in ("via", "pick") else float(extra[1:]) if key in ("late_ms", "reserve")
                    else int(extra[1:]))
    return out


def _timed(fn, into: list):
    """``fn`` wrapped to append its wall time to ``into`` (from any thread); ``__wrapped__`` is ``fn``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


def _cpu_seconds(pid: int, tid: int | None = None) -> float:
    """CPU time (user + system) of a process, or of one of its threads, from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_names() -> dict[int, str]:
    """This process's threads by native id: Python's names, else the kernel's (threads libraries started)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid not in names:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names[tid] = f.read().strip()
            except OSError:
                pass
    return names


def _cpu_snapshot(worker_pids) -> dict[str, float]:
    """CPU seconds so far: per thread of this process (grouped by name), and all workers together."""
    out: dict[str, float] = {}
    pid = os.getpid()
    for tid, name in _thread_names().items():
        key = name.rsplit("_", 1)[0] if name.startswith("gpufeed-decode") else name
        out[key] = out.get(key, 0.0) + _cpu_seconds(pid, tid)
    out["(workers)"] = sum(_cpu_seconds(p) for p in worker_pids)
    return out


def _set_blocking_sync() -> None:
    """Make this process's CUDA context block (not spin) in synchronisations (CU_CTX_SCHED_BLOCKING_SYNC)."""
    torch.cuda.synchronize()  # the primary context exists and is current on this thread
    status = ctypes.CDLL("libcuda.so.1").cuCtxSetFlags(ctypes.c_uint(4))
    if status != 0:
        raise RuntimeError(f"cuCtxSetFlags returned {status}")


def run(data: str, config: str, epochs: int, device: torch.device, monitor: Monitor) -> str:
    c = parse(config)
    map_default = workers.RING_MAP_BYTES
    if c["blocking"]:
        _set_blocking_sync()  # stays for the rest of this process: put b1 configs last
    loader = ImageLoader(data, batch_size=256, num_workers=c["workers"], device=device, decode=c["via"],
                         cpu_share=c["share"])
    if c["map_kb"] is not None:  # read when the loader's pool starts (first epoch); restored below
        workers.RING_MAP_BYTES = c["map_kb"] << 10
    if c["pick"]:  # which samples the CPU's share takes (PipelineSpec.cpu_pick), before the pool starts
        loader.spec = dataclasses.replace(loader.spec, cpu_pick=c["pick"])
    if c["down"] is not None:  # how fast the auto share comes down (this loader only)
        loader._share.MAX_DOWN_STEPS = c["down"]
    if c["rows"] is not None:  # the CPU share's crops: rows for the GPU kernel (1) or resized by the workers (0)
        loader.spec = dataclasses.replace(loader.spec, rows_to_gpu=bool(c["rows"]))
    if c["slots"]:
        loader._num_slots = c["slots"]  # before the first epoch creates the ring
    stage = loader._gpu_stage
    if c["decoders"] != len(stage.decoders):
        decoders, _ = create_gpu_decoder(c["via"], device, threads=c["decoders"])
        stage = GpuDecodeAugment(decoders, device=device, image_size=224, mean=loader.normalize.mean,
                                 std=loader.normalize.std, dtype=torch.float32, channels_last=False,
                                 max_pixels=loader.spec.max_pixels)
        loader._gpu_stage = stage
    if c["job"]:
        stage.job_images = c["job"]
    if c["roi"] is not None:  # region decode on (r1) or off (r0), nvJPEG path only
        for d in stage.decoders:
            d.roi = bool(c["roi"])
        stage._roi = stage._packed and bool(c["roi"])
    if c["late_ms"] is not None:
        loader._share.LATE_S = c["late_ms"] / 1e3
    if c["reserve"] is not None:  # cores "auto" keeps idle
        loader._share.reserve = c["reserve"]
    stage_s: list[float] = []  # per batch: start + finish, in the prefetch thread
    starts: list[float] = []
    start, finish = stage.start, stage.finish

    def timed_start(batch):
        t0 = time.perf_counter()
        out = start(batch)
        starts.append(time.perf_counter() - t0)
        return out

    def timed_finish(started):
        t0 = time.perf_counter()
        out = finish(started)
        stage_s.append(time.perf_counter() - t0 + (starts.pop(0) if starts else 0.0))
        return out

    stage.start, stage.finish = timed_start, timed_finish  # the Prefetcher still sees a staged transform
    loader._prefetcher.transform = stage
    waits: list[float] = []
    collect = workers.WorkerPool.collect

    def timed_collect(self, batch_id):
        out = collect(self, batch_id)
        waits.append(self.last_wait)
        return out

    workers.WorkerPool.collect = timed_collect
    phases = {"decode_wait": [], "decode_into": [], "decode": []}
    originals = [(GpuDecodeAugment, "_await_decode", "decode_wait"), (NvImageCodecDecoder, "decode_into", "decode_into"),
                 (NvImageCodecDecoder, "_decode", "decode"), (NvJpegHwDecoder, "decode_packed", "decode_into"),
                 (NvJpegHwDecoder, "_batched", "decode")]
    for cls, name, phase in originals:
        setattr(cls, name, _timed(getattr(cls, name), phases[phase]))
    rates, inner, busy, shares, pauses = [], [], [], [], []
    gc_pause = _GcPauses()
    try:
        for e in range(epochs + 1):
            if e == 1:
                if c["chunk"]:  # from the first timed epoch's submissions on
                    loader._pool._chunk = c["chunk"]
                for pid in loader.worker_pids:
                    os.setpriority(os.PRIO_PROCESS, pid, c["nice"])
                    if c["kept"] is not None:  # the first k usable cores kept for this process's threads
                        os.sched_setaffinity(pid, sorted(os.sched_getaffinity(0))[c["kept"]:])
                stage_s.clear()
                waits.clear()
                for v in phases.values():
                    v.clear()
                monitor.start()
                cpu0, t_cpu0 = _cpu_snapshot(loader.worker_pids), time.perf_counter()
            n, t0, arrivals, seen = 0, time.perf_counter(), [], []
            gc_pause.reset()
            for images, _ in loader:
                images.sum()
                n += images.shape[0]
                arrivals.append(time.perf_counter())
                seen.append(loader._share.value)
            torch.cuda.synchronize(device)
            if e >= 1:
                shares.append(statistics.mean(seen))
                pauses.append(gc_pause.total)
                rates.append(n / (time.perf_counter() - t0))
                # within the epoch: from the second batch's arrival to the last's (no epoch boundary)
                inner.append(images.shape[0] * (len(arrivals) - 2) / (arrivals[-1] - arrivals[1]))
        monitor.stop()
        busy = monitor.cores_busy
        cpu1, elapsed = _cpu_snapshot(loader.worker_pids), time.perf_counter() - t_cpu0
        threads = sorted(((cpu1[k] - cpu0.get(k, 0.0)) / elapsed, k) for k in cpu1)[::-1]
        cpu_note = ", ".join(f"{k} {v:.2f}" for v, k in threads[:7] if v >= 0.01)
    finally:
        gc_pause.close()
        workers.WorkerPool.collect = collect
        workers.RING_MAP_BYTES = map_default
        for cls, name, _ in originals:
            setattr(cls, name, getattr(cls, name).__wrapped__)
        share = loader.stats["cpu_share"]
        by = loader.stats["decoded_by"]
        loader.close()
    gpu = sum(v for k, v in by.items() if k.startswith("gpu")) / max(1, sum(by.values()))
    per = lambda times: 1e3 * sum(times) / max(1, len(stage_s))  # ms per batch
    return (f"| {config} | {statistics.median(rates):,.0f} | {statistics.median(inner):,.0f} | {share:.2f} | {gpu:.2f} | "
            f"{1e3 * statistics.median(stage_s):.1f} | {1e3 * statistics.median(waits):.1f} | "
            f"{busy:.1f} | {', '.join(f'{r:,.0f}' for r in rates)} | {per(phases['decode_wait']):.1f} | "
            f"{per(phases['decode']):.1f} | {per(phases['decode_into']) - per(phases['decode']):.1f} | "
            f"{per(stage_s) - per(phases['decode_wait']):.1f} | {cpu_note} | "
            f"{', '.join(f'{v:.2f}' for v in shares)} | {', '.join(f'{1e3 * v:.0f}' for v in pauses)} |")


class _GcPauses:
    """Seconds this process spent in the garbage collector (all generations) since ``reset``."""

    def __init__(self) -> None:
        self.total, self._t0 = 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.total = 0.0

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("configs", nargs="*", default=DEFAULT)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_intermixed_args()  # options before or after the configs
    device = torch.device("cuda", torch.cuda.current_device())
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    print("\n".join(l for l in lscpu if l.split(":")[0] in ("Model name", "Thread(s) per core", "Core(s) per socket",
                                                            "Socket(s)", "CPU(s)", "L3 cache")))
    print(f"{workers.usable_cores()} usable cores; GPU {torch.cuda.get_device_name(device)}")
    print("| config | images/s | within epochs | CPU share | GPU-decoded | stage host ms/batch | worker wait ms/batch | cores busy "
          "| epochs | decode wait ms | decode() calls ms | rest of decode_into ms | stage outside the wait ms "
          "| cores busy by thread (this process) and workers | mean CPU share by epoch | GC pauses ms by epoch |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    monitor = Monitor(device.index)
    for config in args.configs:
        try:
            print(run(args.data, config, args.epochs, device, monitor), flush=True)
        except Exception as e:  # one config failing must not lose the others
            print(f"| {config} | FAILED: {type(e).__name__}: {e} |", flush=True)
        # this script's timing wrappers on the stage (stage.start = a closure over stage.start) form a cycle:
        # free the last loader's decoders (nvJPEG states, threads) now, not during a later config's timed
        # epoch (S7-2: one epoch at 6,028 images/s when that happened)
        gc.collect()


if __name__ == "__main__":
    main()
