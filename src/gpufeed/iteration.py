"""One iteration of a loader at a time.

A loader's iteration owns its worker processes' batch slots, its prefetch thread and the epoch's position,
so two at once would hand one slot to two batches. ``iter(loader)`` again, in the thread that holds the live
iteration, ends that one (as a ``break`` would: the position stays where its last batch left it) and takes
over; the ended iterator raises if used again. From another thread, while an iteration is live, it raises:
iterate a loader from one thread, or make a loader per thread. Two threads calling ``next`` on one iterator at
once are refused the same way.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Generator, Iterator


class Iteration:
    """What ``iter(loader)`` returns: the loader's batch generator, guarded (see the module docstring)."""

    def __init__(self, batches: Generator[Any, None, None], name: str) -> None:
        self._batches, self._name = batches, name
        self.thread = threading.get_ident()  # the thread that began it
        self._busy = threading.Lock()
        self._ended_by_later = False

    @property
    def live(self) -> bool:
        """Started or not, and not yet run to its end or closed."""
        return self._batches.gi_frame is not None and not self._ended_by_later

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._ended_by_later:
            raise RuntimeError(f"this iteration of {self._name} was ended by a later iter() of it, which took over "
                               "its workers and the epoch's position: take the batches from that one")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{self._name}: next() on one iteration from two threads at once; iterate a loader "
                               "from one thread, or make one loader per thread")
        try:
            return next(self._batches)
        finally:
            self._busy.release()

    def close(self) -> None:
        """Stop this iteration's work now (as a ``break`` and the iterator's end would)."""
        self._batches.close()

    def end_for_a_later_one(self) -> None:
        self.close()
        self._ended_by_later = True


class OneAtATime:
    """The live iteration of one loader, if any; ``begin`` makes the next."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._live: Callable[[], Iteration | None] = lambda: None
        self._lock = threading.Lock()

    def begin(self, batches: Callable[[], Generator[Any, None, None]]) -> Iteration:
        """A new iteration over ``batches()``, once the live one (if any) has ended: ended here when it is
        this thread's, refused when it is another thread's."""
        with self._lock:
            live = self._live()
            if live is not None and live.live:
                if live.thread != threading.get_ident():
                    raise RuntimeError(f"{self._name} is being iterated in another thread: one iteration at a "
                                       "time; iterate a loader from one thread, or make one loader per thread")
                live.end_for_a_later_one()
            it = Iteration(batches(), self._name)
            self._live = weakref.ref(it)
            return it
