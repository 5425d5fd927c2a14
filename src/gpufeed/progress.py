"""Progress of a long task on stderr: tqdm's bar where stderr is a terminal, else plain lines a log keeps
(each tenth of the work, and at least every ``LINE_EVERY`` seconds while it moves), so no stretch of a run
is silent."""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

LINE_EVERY = 5.0  # seconds between plain lines while work goes on: a log shows the task alive


class Progress:
    """``update(done)`` of ``total`` items (``unit``: "img"), described by ``what``; ``close()`` ends the
    bar or writes the last line. ``stream``: stderr by default; ``shown`` False: counts, shows nothing."""

    def __init__(self, what: str, total: int, unit: str = "img", stream: TextIO | None = None,
                 shown: bool = True) -> None:
        self.what, self.total, self.unit, self.shown = what, total, unit, shown
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._bar = terminal_bar(self.stream, desc=what, total=total, unit=unit, smoothing=0.1) if shown else None
        self._start = self._shown_at = time.monotonic()
        self._shown = 0

    def update(self, done: int) -> None:
        """``done`` items complete in all (not since the last call)."""
        step, self.done = done - self.done, done
        if self._bar is not None:
            self._bar.update(step)
            return
        if not self.shown:
            return
        now = time.monotonic()
        if done * 10 // self.total > self._shown * 10 // self.total or now - self._shown_at >= LINE_EVERY:
            self._line(now)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.shown and self._shown != self.done:
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        self._shown, self._shown_at = self.done, now
        elapsed = now - self._start
        rate = f", {self.done / elapsed:.1f} {self.unit}/s" if elapsed > 0 and self.done else ""
        print(f"{self.what}: {self.done}/{self.total} {self.unit} ({100 * self.done // self.total}%{rate})",
              file=self.stream, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def terminal_bar(stream: TextIO | None = None, **kwargs):
    """tqdm's bar (``kwargs`` are tqdm's) on ``stream``, standard error by default, where it is a terminal;
    None elsewhere (a log, a pipe: the caller writes plain lines or nothing) and without tqdm."""
    stream = stream if stream is not None else sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    try:  # a terminal that reports no size (`docker run -t` without a terminal behind it, `script`): tqdm
        size = os.get_terminal_size(stream.fileno())  # would draw nothing there, so give it 80 x 24
        if size.columns == 0 or size.lines == 0:
            kwargs.setdefault("ncols", size.columns or 80)
            kwargs.setdefault("nrows", size.lines or 24)
    except (OSError, ValueError, AttributeError):
        pass
    return tqdm(file=stream, **kwargs)
