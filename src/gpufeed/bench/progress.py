"""What `gpufeed bench` says while it runs, on standard error: a tqdm bar where standard error is a terminal,
one line per step otherwise (a log, a CI job). The table, CSV or JSON go to standard output alone.

Nothing here runs in a measured process's timed epoch: a child process that measures a pipeline writes a
line to a pipe between its epochs (``EpochPipe``), and the bench's own process shows it (``follow``); the
file count of the synthetic data set is read while no pipeline runs.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

from ..progress import terminal_bar

# The longest the bench goes without a line when standard error is not a terminal (a terminal's bar moves
# every second): under the ~15 s after which a silent command reads as hung.
QUIET_S = 10.0
LOOK_S = 1.0  # how often a child's exit is looked for, and a terminal's bar redrawn


class Progress:
    """The bench's running commentary: ``say`` a line, flushed at once; ``quiet`` (the ranks other than 0
    under torchrun) says nothing."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.quiet = quiet

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)


class FileCount:
    """The files written under ``root`` by a process of their own, new or rewritten, counted while it runs
    (``follow``): a bar moved every second on a terminal, else a line every ``quiet_s`` seconds. The process
    that writes them is not this one: no thread of this process runs beside a fork (the synthetic data set's
    writers are forked)."""

    def __init__(self, progress: Progress, root: Path, n: int, quiet_s: float = QUIET_S) -> None:
        self._progress, self._root, self._n, self._quiet_s = progress, root, n, quiet_s
        self._before = self._stamps()  # a file whose stamp is not this one's was written since

    def _stamps(self) -> dict[str, int]:
        """Each file in the class folders under the root -> its modification time (ns)."""
        stamps: dict[str, int] = {}
        try:
            classes = [e for e in os.scandir(self._root) if e.is_dir()]
        except OSError:  # not made yet
            return stamps
        for folder in classes:
            try:
                stamps.update((f.path, f.stat().st_mtime_ns) for f in os.scandir(folder.path))
            except OSError:  # a file replaced while listed: seen at the next look
                continue
        return stamps

    def written(self) -> int:
        """The files written under the root since this count began."""
        return sum(1 for path, stamp in self._stamps().items() if self._before.get(path) != stamp)

    def follow(self, proc: subprocess.Popen) -> int:
        """Show the count until ``proc`` exits; returns its exit status."""
        bar = None if self._progress.quiet else terminal_bar(total=self._n, desc="synthetic data", unit="img",
                                                             leave=False)
        try:
            while True:
                try:
                    return proc.wait(timeout=LOOK_S if bar is not None else self._quiet_s)
                except subprocess.TimeoutExpired:
                    written = self.written()
                if bar is not None:
                    bar.update(written - bar.n)
                else:
                    self._progress.say(f"  synthetic data: {written:,} of {self._n:,} JPEGs written")
        finally:
            if bar is not None:
                bar.close()


class EpochReport(Protocol):
    """Where a pipeline's epochs are reported as each ends; called between epochs only, so that no timed
    epoch runs its code."""

    def ended(self, seconds: float, images_per_s: float) -> None: ...


class EpochBar:
    """A step's epochs shown as they end: a tqdm bar on a terminal, else one line per epoch; ``running``
    says the step is still at work (the bar's clock moves, or a line) when an epoch is long."""

    def __init__(self, name: str, kinds: list[str], progress: Progress) -> None:
        self._name, self._kinds, self._progress, self._done = name, kinds, progress, 0
        self._since = time.monotonic()  # when the epoch under way began
        self._bar = None if progress.quiet else terminal_bar(total=len(kinds) or None, desc=name, unit="epoch",
                                                             leave=False)

    @property
    def live(self) -> bool:
        """Whether a bar on a terminal shows the step (else lines do)."""
        return self._bar is not None

    def ended(self, seconds: float, images_per_s: float) -> None:
        kind = self._kinds[self._done]
        self._done += 1
        self._since = time.monotonic()
        if self._bar is not None:
            self._bar.set_postfix_str(f"{images_per_s:,.0f} images/s", refresh=False)
            self._bar.update(1)
        else:
            self._progress.say(f"  {self._name} epoch {self._done}/{len(self._kinds)} ({kind}): {seconds:.1f} s, "
                               f"{images_per_s:,.0f} images/s")

    def running(self) -> None:
        if self._bar is not None:
            self._bar.refresh()
            return
        seconds = time.monotonic() - self._since
        if not self._kinds:
            text = f"running, {seconds:.0f} s so far"
        elif self._done < len(self._kinds):
            epoch = f"epoch {self._done + 1}/{len(self._kinds)} ({self._kinds[self._done]})"
            # the first epoch's own time, reported as it ends, leaves out the process's start counted here
            text = f"{'starting, then ' if not self._done else ''}{epoch} running, {seconds:.0f} s so far"
        else:
            text = f"all epochs done; ending (readings, the loader closing), {seconds:.0f} s since the last"
        self._progress.say(f"  {self._name}: {text}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class EpochPipe:
    """A child process's epochs, one JSON line each, written to the pipe its parent reads (``follow``): the
    parent shows them, so that the measured process runs no display code."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def ended(self, seconds: float, images_per_s: float) -> None:
        os.write(self._fd, json.dumps([seconds, images_per_s]).encode() + b"\n")

    def close(self) -> None:
        os.close(self._fd)


def follow(proc: subprocess.Popen, fd: int, bar: EpochBar, deadline: float, quiet_s: float = QUIET_S) -> bool:
    """Show on ``bar`` the epochs the child ``proc`` reports on ``fd`` (``EpochPipe``), and that it is still
    at work when ``quiet_s`` seconds pass without a line (every second, a terminal's bar), until ``proc``
    exits (True) or ``deadline`` (``time.monotonic``) passes (False, ``proc`` still running)."""
    buffer, said, reading = b"", time.monotonic(), True
    while proc.poll() is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        wait = min(left, LOOK_S, quiet_s)  # the child's exit is seen within this, whoever holds the pipe
        if reading:
            ready = bool(select.select([fd], [], [], wait)[0])
        else:  # past the pipe's end (every writer closed it) the child is exiting: only its exit is awaited
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
            ready = False
        if ready:
            chunk = os.read(fd, 1 << 12)
            reading = bool(chunk)
            buffer = _show(buffer + chunk, bar)
            said = time.monotonic()
        elif bar.live or time.monotonic() - said >= quiet_s:
            bar.running()
            said = time.monotonic()
    while reading and select.select([fd], [], [], 0)[0]:  # what it wrote before it exited
        chunk = os.read(fd, 1 << 12)
        reading = bool(chunk)
        buffer = _show(buffer + chunk, bar)
    return True


def _show(buffer: bytes, bar: EpochBar) -> bytes:
    """Each whole line of ``buffer`` shown on ``bar``; the rest, a line not yet ended."""
    *lines, rest = buffer.split(b"\n")
    for line in lines:
        seconds, images_per_s = json.loads(line)
        bar.ended(seconds, images_per_s)
    return rest
