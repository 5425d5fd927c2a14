"""Scheduling: cut the epoch's order into batches, keep the workers' ring slots busy, hand finished
batches on in order.

    sampler order ─► batches of B indices ─► WorkerPool.submit(slot) ... collect ─► HostBatch ─► transfer
                     (while a slot is free)                                          (slot released once
                     next epoch's first batches once this one's last are out           its copies ran)

Slots: one is kept for the consumer; the others carry batches in flight. A slot is reused only once the
transfer stage is done with it (``HostBatch.release``); on CUDA that records an event on the current
stream and the slot is free once the event has completed, since the slots are page-locked and the GPU
reads them directly.

Bad samples (``on_error="skip"``): a batch with failures is compacted and refilled from the next entries
of the order (batches already queued behind it are cancelled and cut again), so delivered samples always
form a prefix of the order minus the skipped ones, and the sampler's position stays exact.

Across epochs: once an epoch's last batches are with the workers, free slots take the next epoch's first
batches, so it starts without a pipeline bubble. They are kept if the next iteration is that epoch from its
start, and cancelled otherwise (another epoch, a loaded state, a ``break``).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import torch

from .decode.base import SkipLog
from .placement import ShareControl
from .ring import SlotView
from .sampling import ShardedSampler
from .workers import WorkerPool
from .workers.records import RETRY, Failure


@dataclass
class HostBatch:
    """One finished batch in a ring slot, as the transfer stage receives it (host side).

    labels: (n,) int64 CPU tensor, copied out of the slot. images: (n, S, S, 3) uint8 CPU tensor viewing the
    slot (CPU decode), or None on the GPU path, where ``slot`` holds each sample's bytes or rows and crop
    box (``ring.Meta``). ``path(i)`` names sample i's file; ``consumed``: entries of the epoch's order this
    batch took (delivered and skipped). ``release()`` hands the slot back once nothing will read it any
    more (on CUDA: once the work queued so far on the current stream has run).
    """

    labels: torch.Tensor
    slot: SlotView
    path: Callable[[int], str]
    consumed: int
    release: Callable[[], None]
    images: torch.Tensor | None = None


class Submitted(NamedTuple):
    """A batch with the workers: its pool id, its ring slot and the sample indices it was given."""

    batch_id: int
    slot: int
    indices: list[int]


class Slots:
    """The ring's slots as one iteration sees them: free, or handed over and maybe still read by the GPU."""

    def __init__(self, num_slots: int, cuda: bool) -> None:
        self.free: collections.deque[int] = collections.deque(range(num_slots))
        self.reading: collections.deque = collections.deque()  # (slot, CUDA event after its last reader)
        self.ids = itertools.count()  # batch ids for the pool
        self._cuda = cuda

    def release(self, slot: int) -> None:
        """Hand ``slot`` back: at once, or on CUDA once the current stream's work so far has run."""
        if not self._cuda:
            self.free.append(slot)
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        self.reading.append((slot, event))

    def reclaim(self, everything: bool = False) -> None:
        """Free the slots whose readers finished; wait for the oldest when fewer than two are free, or for
        all of them with ``everything``."""
        while self.reading and (everything or len(self.free) <= 1 or self.reading[0][1].query()):
            slot, event = self.reading.popleft()
            event.synchronize()
            self.free.append(slot)


@dataclass
class EpochRun:
    """One epoch's order as it is handed to the workers: ``cursor`` entries so far, ``inflight`` batches
    submitted and not yet collected."""

    seed: int
    epoch: int
    order: list[int]
    slots: Slots
    cursor: int = 0
    inflight: collections.deque[Submitted] = field(default_factory=collections.deque)


class Scheduler:
    """Batches of ``batch_size`` from a ``ShardedSampler``'s order, decoded by a ``WorkerPool``.

    ``start_pool()`` makes the pool (again after an error stopped it); ``share`` says how many samples of
    each GPU-path batch the CPU decodes and learns from the workers' lateness; ``skips`` records what
    ``on_error="skip"`` dropped; ``path(i)`` names sample i; ``cuda``: slots are read by CUDA copies.
    """

    def __init__(self, *, start_pool: Callable[[], WorkerPool], num_slots: int, batch_size: int, drop_last: bool,
                 share: ShareControl, skips: SkipLog, path: Callable[[int], str], cuda: bool) -> None:
        self._start_pool, self.num_slots, self.batch_size, self.drop_last = start_pool, num_slots, batch_size, drop_last
        self.share, self.skips, self.path, self.cuda = share, skips, path, cuda
        self.pool: WorkerPool | None = None
        self.ahead: EpochRun | None = None  # the next epoch's first batches, submitted at the end of this one
        self._last_slots: Slots | None = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _full(self, n: int) -> bool:
        """Whether ``n`` samples make a batch: ``batch_size`` of them, or any at all without ``drop_last``."""
        return n == self.batch_size or (n > 0 and not self.drop_last)

    def batches(self, sampler: ShardedSampler) -> Iterator[HostBatch]:
        """The rest of ``sampler``'s current epoch as ``HostBatch`` es, in order (see the module docstring)."""
        if self.pool is None or self.pool.closed:
            self.pool = self._start_pool()
            self.ahead = None
        if self._last_slots is not None:  # the GPU stage released the last batch's slot after that run ended
            self._last_slots.reclaim(everything=True)
        pool, size = self.pool, self.batch_size
        ahead, self.ahead = self.ahead, None
        if ahead is not None and (ahead.seed, ahead.epoch, 0) == (sampler.seed, sampler.epoch, sampler.position):
            run, slots = ahead, ahead.slots  # this epoch's first batches are already with the workers
        else:
            pool.cancel()  # an earlier, abandoned iteration may have batches in flight
            slots = Slots(self.num_slots, self.cuda)
            run = EpochRun(sampler.seed, sampler.epoch, sampler.remaining(), slots)
        nxt: EpochRun | None = None  # the next epoch's run, started early
        finished = False
        try:
            while True:
                slots.reclaim()
                self._submit(run)
                if nxt is None and not self._full(min(size, len(run.order) - run.cursor)):
                    nxt = EpochRun(run.seed, run.epoch + 1, sampler.epoch_indices(run.epoch + 1), slots)
                if nxt is not None:
                    self._submit(nxt)
                if not run.inflight:
                    finished = True
                    return
                batch = run.inflight.popleft()
                view, failures = pool.collect(batch.batch_id)
                collect_wait = pool.last_wait
                consumed, positions = len(batch.indices), list(batch.indices)
                if failures:
                    pool.cancel()  # drops every queued batch: this epoch's later ones and the next epoch's
                    self._take_back(run)
                    if nxt is not None:
                        self._take_back(nxt)
                        nxt = None
                    view, positions, extra = self._refill(batch.slot, view, positions, failures, run)
                    consumed += extra
                if not self._full(len(positions)):
                    slots.free.append(batch.slot)
                    finished = True
                    return  # the epoch's good samples ran out for a full batch (drop_last): the epoch ends
                yield HostBatch(labels=torch.from_numpy(view.labels.copy()),  # tiny: never alias a reused slot
                                slot=view, path=lambda i, p=positions: self.path(p[i]), consumed=consumed,
                                release=lambda s=batch.slot: slots.release(s),
                                images=torch.from_numpy(view.images) if view.meta is None else None)
                self.share.update(collect_wait)
        finally:
            slots.reclaim(everything=True)  # the next iteration's workers may write these slots at once
            self._last_slots = slots
            if self.pool is not None and self.pool.closed:  # stopped by an error: fresh workers next time
                self.pool = None
            elif finished and nxt is not None and nxt.inflight:
                self.ahead = nxt
            elif self.pool is not None:
                self.pool.cancel()

    def _submit(self, run: EpochRun) -> None:
        """Hand ``run``'s next whole batches to the workers while a slot is free (one kept for the consumer)."""
        slots = run.slots
        while len(slots.free) > 1 and self._full(min(self.batch_size, len(run.order) - run.cursor)):
            indices = run.order[run.cursor : run.cursor + self.batch_size]
            batch = Submitted(next(slots.ids), slots.free.popleft(), indices)
            self.pool.submit(batch.batch_id, batch.slot, run.seed, run.epoch, indices,
                             cpu_rows=round(self.share.value * len(indices)))
            run.inflight.append(batch)
            run.cursor += len(indices)

    @staticmethod
    def _take_back(run: EpochRun) -> None:
        """After ``pool.cancel()``: ``run``'s batches in flight give back their slots and order entries."""
        for batch in run.inflight:
            run.slots.free.append(batch.slot)
            run.cursor -= len(batch.indices)
        run.inflight.clear()

    def _refill(self, slot: int, view: SlotView, positions: list[int], failures: list[Failure],
                run: EpochRun) -> tuple[SlotView, list[int], int]:
        """Drop failed samples from a slot, move the rest to the front, top it up from ``run``'s order
        (advancing its cursor); returns the slot's view, its samples' indices and the entries taken."""
        pool, target, extra = self.pool, len(positions), 0
        while failures:
            bad = {f.position for f in failures}
            retry = [positions[f.position] for f in failures if f.reason == RETRY]
            for f in failures:
                if f.reason != RETRY:
                    self.skips.record(f.path, f.reason)
            keep = [k for k in range(len(positions)) if k not in bad]
            for arr in (view.pixels, view.labels, view.meta, view.arena):  # images are a view of the pixels
                if arr is not None:
                    arr[: len(keep)] = arr[keep]
            positions = [positions[k] for k in keep]
            fresh = run.order[run.cursor : run.cursor + max(0, target - len(positions) - len(retry))]
            run.cursor += len(fresh)
            extra += len(fresh)
            take = retry + fresh
            if not take:
                break
            batch_id = next(run.slots.ids)
            pool.submit(batch_id, slot, run.seed, run.epoch, take, start=len(positions))
            view, failures = pool.collect(batch_id)
            positions += take
        return view.head(len(positions)), positions, extra
