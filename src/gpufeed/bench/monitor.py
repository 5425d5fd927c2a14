"""What `gpufeed bench` reads while a pipeline runs, from a sampler process of its own (``bench.sampler``).

The measured process only writes a line to a pipe when a phase starts and ends (and for the one PSS read of
the memory epoch): GPU utilisation and memory (NVML, every 50 ms), the tree's RSS (every 200 ms) and its CPU
time are read by the sampler, on its own core, never by a thread beside the loader's.
(BENCHMARKS.md, "How these are measured", gives each monitor's measured cost.)
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Reading:
    """One phase's readings; None where a part is missing (no NVML, no psutil) or was not read.

    gpu_busy: mean NVML utilisation (%); gpu_mem_start / gpu_mem_peak: NVML "used" bytes at the start and the
    largest seen; rss_start / rss_peak: RSS summed over the process tree (shared pages once per process, as
    ``ps`` shows them); pss_peak: PSS summed over the tree (shared pages split among their processes: the
    tree's real resident memory), read only where ``Monitor.read_pss`` was called; cores_busy: the tree's CPU
    seconds over the phase's wall time (cores kept busy; exited workers count once reaped); machine_cores_busy:
    the same for every process of the machine (``/proc/stat``), so that what others took shows.
    """

    gpu_busy: float | None = None
    gpu_samples: int = 0
    gpu_mem_start: int | None = None
    gpu_mem_peak: int | None = None
    rss_start: int | None = None
    rss_peak: int | None = None
    pss_peak: int | None = None
    cores_busy: float | None = None
    machine_cores_busy: float | None = None


class Pending:
    """A phase's ``Reading``, answered by the sampler while the measured process goes on (``Monitor.stop``)."""

    def __init__(self, monitor: "Monitor") -> None:
        self._monitor, self._reading = monitor, None

    def get(self) -> Reading:
        while self._reading is None:
            self._monitor._take_one()
        return self._reading


class Monitor:
    """``start()`` / ``stop() -> Pending`` around one phase; ``read_pss()`` within one; ``now()`` outside.

    ``start``, ``read_pss`` and ``stop`` only write their line and return: the sampler takes its readings
    while the measured process goes on, so no epoch begins late (a loader fills its pipeline in any pause
    between epochs, which would time the next epoch faster than a plain loop runs it). ``stop`` hands back a
    ``Pending`` whose ``get()`` gives the phase's ``Reading``; the answers come in order.
    ``what``: the sampled monitors ("nvml", "rss"); the CPU time and the readings at a phase's ends are
    always taken. Every answer awaited from the sampler has a deadline (``timeout`` seconds): a sampler that
    does not answer stops the bench with an error rather than hanging it.
    """

    def __init__(self, gpu_index: int | None, *, interval: float = 0.05, what: tuple[str, ...] = ("nvml", "rss"),
                 timeout: float = 30.0) -> None:
        self.timeout = timeout
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gpufeed.bench.sampler", str(os.getpid()),
             str(-1 if gpu_index is None else gpu_index), str(interval), ",".join(what)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        self._pending: list[Pending] = []  # stop answers not yet read, oldest first
        self._buffer = b""
        hello = self._answer()
        self.nvml: str | None = hello["nvml"]  # "ok", or why not
        self.psutil: bool = hello["psutil"]

    def _send(self, command: str) -> None:
        try:
            self._proc.stdin.write(command.encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"gpufeed bench: the sampler process exited (status {self._proc.poll()}) "
                               f"before the command {command!r}") from None

    def _answer(self) -> dict:
        """The sampler's next answer line. Read from the descriptor into a buffer of our own: several answers
        may be waiting at once, and a buffered file's readline would hide the rest from ``select``."""
        fd, deadline = self._proc.stdout.fileno(), time.monotonic() + self.timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk:
                code = self._proc.poll()
                raise RuntimeError(f"gpufeed bench: the sampler process did not answer within {self.timeout:.0f} s"
                                   + ("" if code is None else f" (it exited with status {code})"))
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _take_one(self) -> None:
        """Read the oldest pending stop's answer into it."""
        pending = self._pending.pop(0)
        pending._reading = Reading(**self._answer())

    def start(self) -> None:
        """Begin a phase; the caller does not wait for the sampler."""
        self._send("start")

    def read_pss(self) -> None:
        """Have the sampler read the tree's PSS now; the caller does not wait for it."""
        self._send("pss")

    def stop(self) -> Pending:
        """End the phase; its readings come with the returned ``Pending``'s ``get()``. Answers already
        arrived are taken in, without waiting, so that unread ones never fill the pipe and stall the sampler."""
        self._send(f"stop {time.monotonic()!r}")  # the sampler counts only what it listed before this
        pending = Pending(self)
        self._pending.append(pending)
        fd = self._proc.stdout.fileno()
        while select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the sampler is gone: the next wait says so
                break
            self._buffer += chunk
        while self._pending and b"\n" in self._buffer:
            self._take_one()
        return pending

    def now(self, pss: bool = False) -> dict:
        """The tree's RSS (and PSS, when asked: it stalls the tree), NVML's "used" bytes and the tree's CPU
        seconds now; None for what cannot be read."""
        self._send("now-pss" if pss else "now")
        while self._pending:  # answers come in order: the phases' before this one
            self._take_one()
        return self._answer()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
