"""How many cores this process may use, which of them the loader's workers run on, and how many stay idle.

Two things narrow a machine's cores: the CPU affinity mask (``taskset``, Docker ``--cpuset-cpus``,
torchrun's binding) and the cgroup CPU quota (Docker ``--cpus``, Kubernetes CPU limits), which the
affinity mask does not show: a pod limited to 8 CPUs on a 96-core node sees 96 cores in its mask, and
96 workers there would spend their time throttled. Both are read here. On the GPU path the workers are
kept off a few whole physical cores (``worker_cpus``) for the threads that feed the GPU.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable


def affinity() -> set[int]:
    """The CPUs this process may run on."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> tuple[list[Path], list[Path]]:
    """(cgroup v2 directories, cgroup v1 cpu-controller directories) of this process, deepest first,
    each followed by its ancestors up to the mount point."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return [], []
    v2, v1 = [], []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            base, into = root, v2
        elif "cpu" in controllers.split(","):
            base = next((root / name for name in (controllers, "cpu,cpuacct", "cpu") if (root / name).is_dir()), None)
            if base is None:
                continue
            into = v1
        else:
            continue
        rel = Path(path.lstrip("/"))
        # inside a container the path may name the host's hierarchy while the mount shows only ours
        into += [base / p for p in [rel, *rel.parents] if (base / p).is_dir()] or [base]
    return v2, v1


def cpu_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs the cgroup quota allows this process (e.g. 8.0; the smallest along its cgroup's path), or
    None where there is no quota (or no cgroup file system)."""
    return _quota(*_cgroup_dirs(Path(root), Path(proc_cgroup)))


def _quota(v2: list[Path], v1: list[Path]) -> float | None:
    """The smallest CPU quota set on these cgroup directories, in CPUs; None if none is."""
    limits = []
    for d in v2:
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if quota != "max" and int(period) > 0:
            limits.append(int(quota) / int(period))
    for d in v1:
        try:
            quota, period = int((d / "cpu.cfs_quota_us").read_text()), int((d / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota > 0 and period > 0:
            limits.append(quota / period)
    return min(limits) if limits else None


def usable_cores() -> int:
    """Cores this process may keep busy: its affinity mask (which containers and torchrun narrow), and no
    more than its cgroup CPU quota (rounded down, at least 1)."""
    cores, limit = len(affinity()), cpu_limit()
    return max(1, min(cores, int(limit))) if limit is not None else cores


def _thread_siblings(cpu: int) -> set[int]:
    """The logical CPUs of ``cpu``'s physical core (SMT siblings), from sysfs; ``{cpu}`` where unknown."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return {cpu}
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        if a.isdigit() and (not b or b.isdigit()):
            out.update(range(int(a), int(b or a) + 1))
    return out | {cpu}


def worker_cpus(kept: int, *, least: int, most: float, mask: set[int] | None = None,
                siblings: Callable[[int], set[int]] = _thread_siblings) -> set[int] | None:
    """The CPUs for the loader's worker processes: this process's mask (``mask``: default ``affinity()``)
    without its ``kept`` lowest physical cores (with their SMT siblings, so that no worker shares a core
    with them), which stay free of workers for the threads that must not wait for a core. At most ``most``
    of the mask is kept; None (no restriction) on a mask of fewer than ``least`` CPUs or where ``kept`` < 1.
    (The numbers are the placement policy's: ``placement.cpus``.)"""
    cpus = sorted(affinity() if mask is None else mask)
    if len(cpus) < least or kept < 1:
        return None
    free, taken = set(cpus), 0
    for c in cpus:
        if taken == kept:
            break
        if c not in free:  # a sibling of a core kept already
            continue
        core = siblings(c) & free
        if len(cpus) - len(free) + len(core) > int(len(cpus) * most):
            break
        free -= core
        taken += 1
    return free if taken else None


def cpu_ranges(cpus: set[int]) -> str:
    """CPU numbers as ranges, e.g. {0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(run)
            run = []
        run.append(c)
    out += [run] if run else []
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


class IdleCores:
    """Idle cores among those this process may use, averaged over windows of ``WINDOW_S``.

    Under a cgroup CPU quota smaller than the affinity mask (cgroup v2): the quota minus what this
    process's cgroup used (``cpu.stat``; the loader's workers are in it too). Otherwise the idle time of
    the mask's CPUs in ``/proc/stat``, which counts every process's load, e.g. other ranks' loaders.
    """

    WINDOW_S = 0.1

    def __init__(self, stat: str = "/proc/stat", clock: Callable[[], float] = time.monotonic,
                 cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> None:
        self.path, self.clock = stat, clock
        self.cpus = {f"cpu{c}" for c in affinity()}
        v2, v1 = _cgroup_dirs(Path(cgroup_root), Path(proc_cgroup))
        limit = _quota(v2, v1)
        self._usage_file = v2[0] / "cpu.stat" if limit is not None and limit < len(self.cpus) and v2 else None
        self.capacity = min(float(len(self.cpus)), limit) if limit is not None else float(len(self.cpus))
        self._last = self._read()
        self.window_s = 0.0  # the length of the window ``poll`` last read

    def _read(self) -> tuple[float, float | None, float | None]:
        """(time, a, b): under the quota a = core-seconds used by our cgroup (b unused), else a = idle and
        b = all jiffies of our CPUs in /proc/stat; a = None where nothing could be read."""
        now = self.clock()
        try:
            if self._usage_file is not None:
                usage = next(int(l.split()[1]) for l in self._usage_file.read_text().splitlines()
                             if l.startswith("usage_usec "))
                return now, usage / 1e6, None
            with open(self.path) as f:
                lines = [l.split() for l in f if l.startswith("cpu") and not l.startswith("cpu ")]
        except (OSError, StopIteration, ValueError, IndexError):
            return now, None, None
        idle = total = 0
        for fields in lines:
            if fields[0] in self.cpus:
                values = [int(v) for v in fields[1:9]]
                idle += values[3] + values[4]  # idle + iowait
                total += sum(values)
        return now, idle, total

    def poll(self) -> float | None:
        """Idle cores over the window that just ended; None if it has not ended. Where nothing can be
        read (not Linux), every core counts as idle."""
        if self.clock() - self._last[0] < self.WINDOW_S:
            return None
        last, self._last = self._last, self._read()
        self.window_s = self._last[0] - last[0]
        if last[1] is None or self._last[1] is None:
            return self.capacity
        if self._usage_file is not None:  # the quota minus what our cgroup used
            return max(0.0, self.capacity - (self._last[1] - last[1]) / (self._last[0] - last[0]))
        if self._last[2] <= last[2]:
            return None
        return len(self.cpus) * (self._last[1] - last[1]) / (self._last[2] - last[2])
