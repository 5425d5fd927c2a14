"""Buffers handed out again once nothing outside their pool refers to them (the GPU stage's output batches,
a CPU device's float32 batches): a batch the training let go is written again in place, so the memory held
stays what is in flight (BENCHMARKS.md#memory); one the user keeps is theirs, and a new one is made."""

from __future__ import annotations

import threading
from typing import Any, Callable


class ReusePool:
    """The newest ``keep`` buffers. ``is_free(items, k)``: nothing but the pool refers to ``items[k]`` (asked
    of the list, so that the question itself holds no reference). Safe to use from several threads."""

    def __init__(self, keep: int, is_free: Callable[[list, int], bool]) -> None:
        self.keep = keep
        self._is_free = is_free
        self._items: list[Any] = []
        self._lock = threading.Lock()

    def take(self, fits: Callable[[Any], bool], make: Callable[[], Any] | None = None) -> Any | None:
        """The free buffer used last that ``fits`` (its pages the likeliest to be in the caches), moved to
        the newest place; else, with ``make``, a new one (free buffers that do not fit are let go first),
        else None."""
        with self._lock:
            free = [k for k in range(len(self._items)) if self._is_free(self._items, k)]
            fitting = [k for k in free if fits(self._items[k])]
            if fitting:
                self._items.append(self._items.pop(fitting[-1]))
                return self._items[-1]
            if make is None:
                return None
            for k in reversed(free):
                del self._items[k]
            return self._add(make())

    @property
    def held(self) -> tuple[Any, ...]:
        """The buffers the pool holds, oldest first."""
        with self._lock:
            return tuple(self._items)

    def add(self, item: Any) -> Any:
        """Keep ``item`` (the oldest goes when ``keep`` are held: batches the user keeps go with them)."""
        with self._lock:
            return self._add(item)

    def _add(self, item: Any) -> Any:
        if len(self._items) >= self.keep:
            self._items.pop(0)
        self._items.append(item)
        return item
