"""The bench's sampler: a process of its own that watches the measured process tree, so that no sampling runs
in the process being timed (a sampling thread there takes the interpreter lock beside the loader's threads).

    python -m gpufeed.bench.sampler PID GPU_INDEX INTERVAL_S [nvml,rss]

GPU_INDEX -1: no GPU. The last argument names what is sampled (default both: NVML utilisation and "used"
memory; the tree's summed RSS, every fourth interval); ``benchmarks/monitor_cost.py`` times each alone.
One JSON object per line answers each command read from standard input:

- ``start``: begin a phase, reading the tree's RSS, NVML's "used" bytes and the tree's CPU seconds now;
  answers nothing (the measured process does not wait: its epoch has begun).
- ``now``: the same readings, without starting anything; ``now-pss``: with the tree's PSS too.
- ``pss``: read the tree's PSS (and RSS) now, into the phase's peaks; answers nothing, so the measured
  process does not wait for the read (which walks every process's page tables under its memory-map lock).
- ``stop T``: end the phase, ``T`` being the measured process's ``time.monotonic()`` when it sent the
  command (one clock for every process on the host); answers its readings (``Reading`` in ``monitor.py``).
  The sampled peaks count only readings whose process list was taken before ``T``: a sampler that runs
  late on a loaded machine does not put into this phase a process the measured one started after it.

End of input (the measured process closing the pipe, or exiting) ends the sampler. Imports neither torch
nor the loader: it starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any


class _Tree:
    """The process ``pid`` and its descendants, read through psutil (None where psutil is missing)."""

    def __init__(self, pid: int) -> None:
        try:
            import psutil
        except ImportError:
            self.psutil = self.root = None
            return
        self.psutil, self.root = psutil, psutil.Process(pid)

    def _members(self) -> list:
        """The tree, less this sampler (a child of the measured process: its own reads are not the tree's)."""
        try:
            return [p for p in (self.root, *self.root.children(recursive=True)) if p.pid != os.getpid()]
        except self.psutil.NoSuchProcess:
            return []

    def memory(self, pss: bool = False) -> tuple[int | None, int | None, float]:
        """(RSS, PSS, when the tree was listed) summed over the tree; PSS None unless asked for and readable
        for every member. RSS counts shared pages once per process, as ``ps`` does; PSS splits them among
        their processes."""
        if self.psutil is None:
            return None, None, time.monotonic()
        rss, pss_sum, pss_ok = 0, 0, pss
        members = self._members()
        listed = time.monotonic()
        for p in members:
            try:
                try:
                    m = p.memory_full_info() if pss else p.memory_info()
                except self.psutil.AccessDenied:
                    m = p.memory_info()
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):  # a worker that just exited
                continue
            rss += m.rss
            if getattr(m, "pss", None) is None:
                pss_ok = False
            else:
                pss_sum += m.pss
        return rss, (pss_sum if pss_ok else None), listed

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds of the tree, reaped children included."""
        if self.psutil is None:
            return None
        total = 0.0
        for p in self._members():
            try:
                t = p.cpu_times()
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total


class _Gpu:
    """NVML's utilisation and "used" memory of one GPU; ``error`` says why not where NVML is missing."""

    def __init__(self, index: int) -> None:
        self.nvml = self.handle = None
        self.error: str | None = None if index >= 0 else "not used (no GPU)"
        if index < 0:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.nvml = pynvml
        except Exception as e:  # NVML missing or no driver: report, don't fail
            self.error = f"{type(e).__name__}: {e}"

    def utilisation(self) -> int | None:
        return None if self.nvml is None else self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu

    def used(self) -> int | None:
        return None if self.nvml is None else self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used


class Sampler:
    """One phase's readings, sampled every ``interval`` seconds while a phase runs."""

    def __init__(self, pid: int, gpu_index: int, interval: float, what: set[str]) -> None:
        self.tree, self.gpu, self.interval = _Tree(pid), _Gpu(gpu_index), interval
        self.sample_nvml, self.sample_rss = "nvml" in what, "rss" in what
        self.active = False
        self._reset()

    def _reset(self) -> None:
        self.util: list[int] = []
        self.gpu_peak = None
        self.memory: list[tuple[float, int | None, int | None]] = []  # (listed at, RSS, PSS) this phase
        self.start: dict[str, Any] = {}
        self.tick = 0

    def now(self, pss: bool = False) -> dict[str, Any]:
        return self._now(pss)[0]

    def _now(self, pss: bool = False) -> tuple[dict[str, Any], float]:
        """The readings of ``now``, and when the tree was listed for them."""
        rss, pss_sum, listed = self.tree.memory(pss)
        return {"rss": rss, "pss": pss_sum, "gpu_used": self.gpu.used(), "cpu_seconds": self.tree.cpu_seconds(),
                "machine_cpu_seconds": machine_cpu_seconds(), "time": time.monotonic()}, listed

    def begin(self) -> dict[str, Any]:
        self._reset()
        self.start, listed = self._now()
        self.memory.append((listed, self.start["rss"], None))
        self.gpu_peak = self.start["gpu_used"]
        self.active = True
        return self.start

    def read_pss(self) -> None:
        rss, pss, _ = self.tree.memory(pss=True)
        self.memory.append((float("-inf"), rss, pss))  # asked for within the phase: counts however late

    def sample(self) -> None:
        if self.sample_nvml:
            util = self.gpu.utilisation()
            if util is not None:
                self.util.append(util)
            self.gpu_peak = _max(self.gpu_peak, self.gpu.used())
        if self.sample_rss and self.tick % 4 == 0:
            rss, _, listed = self.tree.memory()
            self.memory.append((listed, rss, None))
        self.tick += 1

    def end(self, sent: float | None = None) -> dict[str, Any]:
        """End the phase that the measured process ended at ``sent`` (its monotonic clock; None: now)."""
        self.active = False
        end, listed = self._now()
        self.memory.append((listed, end["rss"], None))
        self.gpu_peak = _max(self.gpu_peak, end["gpu_used"])
        kept = [m for m in self.memory if sent is None or m[0] <= sent] or self.memory[:1]  # none listed in time: the start's
        rss_peak = pss_peak = None
        for _, rss, pss in kept:
            rss_peak, pss_peak = _max(rss_peak, rss), _max(pss_peak, pss)
        cpu0, cpu1, wall = self.start.get("cpu_seconds"), end["cpu_seconds"], end["time"] - self.start["time"]
        return {"gpu_busy": sum(self.util) / len(self.util) if self.util else None, "gpu_samples": len(self.util),
                "gpu_mem_start": self.start["gpu_used"], "gpu_mem_peak": self.gpu_peak,
                "rss_start": self.start["rss"], "rss_peak": rss_peak, "pss_peak": pss_peak,
                "cores_busy": (cpu1 - cpu0) / max(wall, 1e-9) if cpu0 is not None and cpu1 is not None else None,
                "machine_cores_busy": _per_second(self.start.get("machine_cpu_seconds"), end["machine_cpu_seconds"],
                                                  wall)}


def machine_cpu_seconds() -> float | None:
    """CPU seconds every process of the machine has used (``/proc/stat``: all but idle and I/O wait); None where
    it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        values = [int(v) for v in fields[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def _per_second(a: float | None, b: float | None, wall: float) -> float | None:
    return (b - a) / max(wall, 1e-9) if a is not None and b is not None else None


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def serve(sampler: Sampler, stdin, stdout) -> None:
    """Answer commands from ``stdin`` (see the module docstring) until it ends."""
    hello = {"nvml": "ok" if sampler.gpu.nvml is not None else sampler.gpu.error,
             "psutil": sampler.tree.psutil is not None}
    print(json.dumps(hello), file=stdout, flush=True)
    fd, buffer, due = stdin.fileno(), b"", time.monotonic()
    while True:
        timeout = max(0.0, due - time.monotonic()) if sampler.active else None
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:  # the interval ended with no command: sample
            sampler.sample()
            due = time.monotonic() + sampler.interval
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            command, *args = line.decode().split() or [""]
            if command == "start":
                sampler.begin()
                due = time.monotonic() + sampler.interval
            elif command in ("now", "now-pss"):
                print(json.dumps(sampler.now(pss=command == "now-pss")), file=stdout, flush=True)
            elif command == "pss":
                sampler.read_pss()
            elif command == "stop":
                print(json.dumps(sampler.end(float(args[0]) if args else None)), file=stdout, flush=True)
            else:
                print(json.dumps({"error": f"unknown command {command!r}"}), file=stdout, flush=True)


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    what = set(argv[3].split(",")) if len(argv) == 4 and argv[3] else {"nvml", "rss"}
    serve(Sampler(int(argv[0]), int(argv[1]), float(argv[2]), what), sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
