"""What travels between the main process and the workers: typed records, standard library only
(a worker unpickles them before it may import numpy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class WorkerError(RuntimeError):
    """A worker process died or failed; the message names the worker and the file."""


class OutputSize(NamedTuple):
    """The size a batch is made at (progressive resizing: at most the size the ring was made for): ``image``
    x ``image`` squares; validation resizes the shorter side to ``resize`` first."""

    image: int
    resize: int


class Task(NamedTuple):
    """One chunk of a batch: load ``indices`` of epoch ``epoch`` into positions ``start...`` of ``slot``, at
    ``size``. ``cpu_quota``: on the GPU path, how many of them the CPU decodes (the rest stay encoded).
    A task whose ``generation`` is not the pool's current one belongs to an abandoned epoch: it is
    acknowledged, not decoded."""

    generation: int
    batch_id: int
    chunk_id: int
    slot: int
    seed: int
    epoch: int
    start: int
    indices: list[int]
    cpu_quota: int
    size: OutputSize


@dataclass(frozen=True, order=True)
class Failure:
    """A sample that did not load: its position in the slot, its file and why.
    ``reason == RETRY`` marks a good sample left undone by a worker that died."""

    position: int
    path: str | None
    reason: str
    traceback: str = ""


RETRY = "retry"


class ChunkDone(NamedTuple):
    """A worker's answer to a ``Task``: the chunk is in the slot, but for ``failures``. ``finished``: when,
    on ``time.monotonic()`` (one clock for every process of the machine)."""

    generation: int
    batch_id: int
    chunk_id: int
    failures: list[Failure]
    finished: float = 0.0


class InHand(NamedTuple):
    """The sample a worker is working on: where it goes, and since when (``time.monotonic``)."""

    batch_id: int
    chunk_id: int
    position: int
    since: float


class Progress:
    """One worker's sample in hand, in a shared array the main process reads to name the file when the
    worker dies or hangs. Written by the worker, read by the pool."""

    _IDLE = (-1.0, -1.0, -1.0, 0.0)

    def __init__(self, shared: Any) -> None:
        self._a = shared  # multiprocessing Array("d", 4)

    @classmethod
    def create(cls, ctx: Any) -> "Progress":
        return cls(ctx.Array("d", cls._IDLE, lock=False))

    def __reduce__(self):  # travels to the worker as its shared array, at process start
        return Progress, (self._a,)

    def hold(self, batch_id: int, chunk_id: int, position: int, since: float) -> None:
        self._a[:] = (batch_id, chunk_id, position, since)

    def clear(self) -> None:
        self._a[:] = self._IDLE

    def read(self) -> InHand | None:
        batch_id, chunk_id, position, since = self._a[:]
        return None if batch_id < 0 else InHand(int(batch_id), int(chunk_id), int(position), since)
