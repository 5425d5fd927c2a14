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
    worker dies or hangs. Written by the worker, read by the pool.

    The record's four values are written one at a time while the pool may read them, so a sequence number
    brackets each write (a seqlock): odd while a write is under way, and a read that saw it move, or odd, is
    taken again. A read never mixes two records (a held sample with the idle record's time would look held
    since the machine started, and be stopped for ``sample_timeout``)."""

    _IDLE = (-1.0, -1.0, -1.0, 0.0)
    _SEQ = 4  # the sequence number's place, after the record

    def __init__(self, shared: Any) -> None:
        self._a = shared  # multiprocessing Array("d", 5)

    @classmethod
    def create(cls, ctx: Any) -> "Progress":
        return cls(ctx.Array("d", (*cls._IDLE, 0.0), lock=False))

    def __reduce__(self):  # travels to the worker as its shared array, at process start
        return Progress, (self._a,)

    def _write(self, record: tuple[float, float, float, float]) -> None:
        a, seq = self._a, self._a[self._SEQ]
        a[self._SEQ] = seq + 1  # odd: being written
        a[0:4] = record
        a[self._SEQ] = seq + 2

    def hold(self, batch_id: int, chunk_id: int, position: int, since: float) -> None:
        self._write((batch_id, chunk_id, position, since))

    def clear(self) -> None:
        self._write(self._IDLE)

    def read(self) -> InHand | None:
        """The sample in hand, or None: idle, or still being written after a few tries (the pool's next poll
        looks again)."""
        for _ in range(100):
            seq = self._a[self._SEQ]
            batch_id, chunk_id, position, since = self._a[0:4]
            if seq % 2 == 0 and self._a[self._SEQ] == seq:
                return None if batch_id < 0 else InHand(int(batch_id), int(chunk_id), int(position), since)
        return None
