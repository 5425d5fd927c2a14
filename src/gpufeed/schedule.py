"""Scheduling: cut the epoch's order into batches, keep the workers' ring slots busy, hand finished
batches on in order.

    sampler order ─► batches of B indices ─► WorkerPool.submit(slot) ... collect ─► HostBatch ─► transfer
                     (while a slot is free)                                          (slot released once
                     next epoch's first batches once this one's last are out           its copies ran)

Slots: one is kept for the consumer; the others carry batches in flight. A slot is reused only once the
transfer stage is done with it (``HostBatch.release``); on CUDA that records an event on the current
stream and the slot is free once the event has completed, since the slots are page-locked and the GPU
reads them directly.

Bad samples (``on_error="skip"``): a sample a worker could not load is replaced in its batch by a good
sample of the same batch (``decode.base.stand_ins``); a batch whose samples all failed is filled from the
next entries of the order, which stay in their own batches too. Every batch keeps the entries it was cut
with, so every rank yields ``len(loader)`` full batches and the sampler's position is exact and the same
on every rank. Samples a dead worker left undone are loaded again first. Each entry of the order that fails
is recorded once, however often it is loaded; failures that are an outage (``options.is_outage``) raise,
naming the first ones.

Sources read whole group by group (remote shards, Parquet row groups: ``readahead``): the source is told
this rank's order of each epoch (which holds about ``1 / world_size`` of the groups: ``sampling``, "Grouped
order"), and as batches go to the workers, how far they have got, so groups are fetched or extracted
ahead of the workers and deleted once the order has passed them. Once an epoch's are all under way, the
next epoch's order is told too, so its first groups are ready when its batches start (and a group both
orders want is kept for the next).

Across epochs: once an epoch's last batches are with the workers, free slots take the next epoch's first
batches, so it starts without a pipeline bubble. They are kept if the next iteration is that epoch from its
start at the same image size, and cancelled otherwise (another epoch, a loaded state, a ``break``, a new
size from ``ImageLoader.set_image_size``).

Image size: each iteration makes its batches at the size it is given (``batches(sampler, size)``), at most
the ring's; the epoch started early takes the same size, and is kept only if the next iteration asks for it.
"""

from __future__ import annotations

import collections
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import torch

from .decode.base import SkipLog, stand_ins
from .options import OUTAGE_BATCHES, OUTAGE_FRACTION, is_outage
from .placement import ShareControl
from .records import KIND_BYTES, KIND_PIXELS, KIND_ROWS, HostBatch, Meta
from .ring import SlotView
from .sampling import ShardedSampler
from .workers import WorkerPool
from .workers.records import RETRY, Failure, OutputSize, WorkerError


class Submitted(NamedTuple):
    """A batch with the workers: its pool id, its ring slot, the sample indices it was given and where they
    start in the run's order."""

    batch_id: int
    slot: int
    indices: list[int]
    first: int


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
        event = torch.cuda.Event(blocking=True)  # a wait for it sleeps: a spinning one takes a worker's core
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
    """One epoch's order as it is handed to the workers, at image ``size``: ``cursor`` entries so far,
    ``inflight`` batches submitted and not yet collected."""

    seed: int
    epoch: int
    order: list[int]
    slots: Slots
    size: OutputSize | None
    cursor: int = 0
    inflight: collections.deque[Submitted] = field(default_factory=collections.deque)
    fetch: Any = None  # the source's readahead along ``order`` (``sources.spool.Readahead``), if it has one
    failed: set[int] = field(default_factory=set)  # entries of the order whose failure is recorded
    first_failures: list[tuple[str | None, str]] = field(default_factory=list)  # (path, reason) of the first few
    failed_batches: int = 0  # batches in a row (refills included) in which no sample loaded

    def progress(self) -> None:
        """Tell the readahead how far the workers have got: entries submitted, and entries delivered."""
        if self.fetch is not None:
            self.fetch.at(self.cursor, self.inflight[0].first if self.inflight else self.cursor)

    def close(self) -> None:
        if self.fetch is not None:
            self.fetch.close()


class Scheduler:
    """Batches of ``batch_size`` from a ``ShardedSampler``'s order, decoded by a ``WorkerPool``.

    ``start_pool()`` makes the pool (again after an error stopped it); ``share`` says how many samples of
    each GPU-path batch the CPU decodes and learns from the workers' lateness; ``skips`` records what
    ``on_error="skip"`` dropped; ``path(i)`` names sample i; ``cuda``: slots are read by CUDA copies;
    ``readahead(order)``: the source's fetcher along an epoch's order (None: a source read in place).
    ``stand_ins`` (training): a good sample of its batch takes a skipped one's place, so every batch keeps its
    size; False (validation, which must count each image once): the skipped sample leaves its batch, which
    comes smaller (empty, if none of it loaded: the loader yields no empty batch).
    """

    def __init__(self, *, start_pool: Callable[[], WorkerPool], num_slots: int, batch_size: int, drop_last: bool,
                 share: ShareControl, skips: SkipLog, path: Callable[[int], str], cuda: bool,
                 readahead: Callable[[list[int]], Any] | None = None, stand_ins: bool = True) -> None:
        self._start_pool, self.num_slots, self.batch_size, self.drop_last = start_pool, num_slots, batch_size, drop_last
        self.stand_ins = stand_ins
        self.share, self.skips, self.path, self.cuda = share, skips, path, cuda
        self.readahead = readahead
        self.pool: WorkerPool | None = None
        self.ahead: EpochRun | None = None  # the next epoch's first batches, submitted at the end of this one
        self._last_slots: Slots | None = None

    def _run(self, seed: int, epoch: int, order: list[int], slots: Slots, size: OutputSize | None) -> EpochRun:
        return EpochRun(seed, epoch, order, slots, size, fetch=self.readahead(order) if self.readahead else None)

    def close(self) -> None:
        if self.pool is not None:  # first: a worker never fetches again a file the readahead just deleted
            self.pool.close()
            self.pool = None
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None

    def _full(self, n: int) -> bool:
        """Whether ``n`` samples make a batch: ``batch_size`` of them, or any at all without ``drop_last``."""
        return n == self.batch_size or (n > 0 and not self.drop_last)

    def batches(self, sampler: ShardedSampler, size: OutputSize | None = None) -> Iterator[HostBatch]:
        """The rest of ``sampler``'s current epoch as ``HostBatch`` es, in order, made at ``size`` (None: the
        pool's own; see the module docstring)."""
        if self.pool is None or self.pool.closed:
            self.pool = self._start_pool()
            if self.ahead is not None:
                self.ahead.close()
            self.ahead = None
        if self._last_slots is not None:  # the GPU stage released the last batch's slot after that run ended
            self._last_slots.reclaim(everything=True)
        pool, per_batch = self.pool, self.batch_size
        ahead, self.ahead = self.ahead, None
        if ahead is not None and (ahead.seed, ahead.epoch, ahead.size) == (sampler.seed, sampler.epoch, size) and \
                sampler.at_epoch_start:
            run, slots = ahead, ahead.slots  # this epoch's first batches are already with the workers
        else:
            pool.cancel()  # an earlier, abandoned iteration may have batches in flight
            if ahead is not None:
                ahead.close()
            slots = Slots(self.num_slots, self.cuda)
            run = self._run(sampler.seed, sampler.epoch, sampler.remaining(), slots, size)
        nxt: EpochRun | None = None  # the next epoch's run, started early
        finished = False
        try:
            while True:
                slots.reclaim()
                self._submit(run)
                run.progress()
                submitted = not self._full(min(per_batch, len(run.order) - run.cursor))  # all this epoch's batches
                if nxt is None and (submitted or run.fetch is not None and run.fetch.exhausted):
                    nxt = self._run(run.seed, run.epoch + 1, sampler.epoch_indices(run.epoch + 1), slots, size)
                if nxt is not None:
                    if submitted:
                        self._submit(nxt)
                    nxt.progress()
                if not run.inflight:
                    if self._full(min(per_batch, len(run.order) - run.cursor)):  # entries left, yet no slot was free
                        raise RuntimeError(f"no free ring slot for the rest of epoch {run.epoch}: every slot is still "
                                           "held by batches handed on and not released")
                    finished = True
                    return
                batch = run.inflight.popleft()
                view, failures = pool.collect(batch.batch_id)
                collect_wait = pool.last_wait
                indices = list(batch.indices)
                if failures and self.stand_ins:
                    view = self._stand_in(batch, view, indices, failures, run)
                elif failures:
                    view, indices = self._leave_out(batch, view, indices, failures, run)
                yield HostBatch(labels=torch.from_numpy(view.labels.copy()),  # tiny: never alias a reused slot
                                slot=view, indices=indices, consumed=len(batch.indices),
                                release=functools.partial(slots.release, batch.slot),
                                path=lambda i, p=indices: self.path(p[i]),
                                images=None if view.meta is not None else torch.from_numpy(
                                    view.images if view.output is None else view.output),
                                seed=run.seed, epoch=run.epoch)
                self.share.update(collect_wait)
        finally:
            slots.reclaim(everything=True)  # the next iteration's workers may write these slots at once
            self._last_slots = slots
            keep = finished and nxt is not None and nxt.inflight and not (self.pool is not None and self.pool.closed)
            if self.pool is not None and self.pool.closed:  # stopped by an error: fresh workers next time
                self.pool = None
            elif keep:
                self.ahead = nxt
            elif self.pool is not None:
                self.pool.cancel()  # before the readaheads close: no worker fetches again what they delete
            run.close()
            if nxt is not None and not keep:
                nxt.close()

    def _submit(self, run: EpochRun) -> None:
        """Hand ``run``'s next whole batches to the workers while a slot is free (one kept for the consumer)."""
        slots = run.slots
        while len(slots.free) > 1 and self._full(min(self.batch_size, len(run.order) - run.cursor)):
            indices = run.order[run.cursor : run.cursor + self.batch_size]
            batch = Submitted(next(slots.ids), slots.free.popleft(), indices, run.cursor)
            self.pool.submit(batch.batch_id, batch.slot, run.seed, run.epoch, indices,
                             cpu_rows=round(self.share.value * len(indices)), size=run.size)
            run.inflight.append(batch)
            run.cursor += len(indices)

    def _stand_in(self, batch: Submitted, view: SlotView, indices: list[int], failures: list[Failure],
                  run: EpochRun) -> SlotView:
        """Samples a dead worker left undone are loaded again; each failed one is recorded and replaced by a
        good sample of the batch (``stand_ins``), copied within the slot; ``indices`` follows. A batch with
        no good sample is first filled from the next entries of the order (wrapping to its start)."""
        n = len(indices)
        entries = list(range(batch.first, batch.first + n))  # the entry of the order at each position
        bad = self._reload(batch.slot, indices, entries, failures, run)
        repeats = len(bad)
        ahead = list(range(batch.first + n, len(run.order))) + list(range(batch.first))  # positions in the order
        while len(bad) == n:  # nothing to stand in: load the next entries of the order into the whole slot
            run.failed_batches += 1
            self._check_outage(run)
            if not ahead:
                last = self.skips.listed[-1][0] if self.skips.listed else None
                raise WorkerError(f"no sample of this rank's epoch {run.epoch} could be loaded under "
                                  f"on_error='skip' (the last that failed: {last!r})")
            positions, ahead = ahead[:n], ahead[n:]
            take = [run.order[p] for p in positions]
            indices[: len(take)] = take
            entries[: len(take)] = positions
            failed = self._load(batch.slot, run, take, 0)
            bad = self._reload(batch.slot, indices, entries, failed, run) | set(range(len(take), n))
            if run.fetch is not None:  # read now: an item the order had passed goes again
                run.fetch.loaded_again(positions)
            repeats = n  # every sample of this batch is delivered in its own batch as well
        run.failed_batches = 0
        self._check_outage(run)
        for p, g in stand_ins(n, bad).items():
            _move(view, g, p)
            indices[p] = indices[g]
        self.skips.repeated += repeats
        return view

    def _leave_out(self, batch: Submitted, view: SlotView, indices: list[int], failures: list[Failure],
                   run: EpochRun) -> tuple[SlotView, list[int]]:
        """Without stand-ins: samples a dead worker left undone are loaded again, each failed one recorded and
        taken out of the batch, the good ones moved up in order within the slot; the shorter view and its
        indices."""
        entries = list(range(batch.first, batch.first + len(indices)))
        bad = self._reload(batch.slot, indices, entries, failures, run)
        run.failed_batches = run.failed_batches + 1 if len(bad) == len(indices) else 0
        self._check_outage(run)
        good = [p for p in range(len(indices)) if p not in bad]
        for k, g in enumerate(good):
            if k != g:
                _move(view, g, k)
        return view.head(len(good)), [indices[g] for g in good]

    def _reload(self, slot: int, indices: list[int], entries: list[int], failures: list[Failure],
                run: EpochRun) -> set[int]:
        """Load again, in place, the positions a dead worker left undone; record every other failure, once
        per entry of the order (``entries``: each position's). The positions that failed."""
        bad: set[int] = set()
        while failures:
            retry = sorted(f.position for f in failures if f.reason == RETRY)
            for f in failures:
                if f.reason != RETRY:
                    bad.add(f.position)
                    if entries[f.position] not in run.failed:  # a refill loads entries of later batches too
                        run.failed.add(entries[f.position])
                        self.skips.record(f.path, f.reason)
                        if len(run.first_failures) < 3:
                            run.first_failures.append((f.path, f.reason))
            failures = []
            for first, last in _runs(retry):  # each run of consecutive positions in one call
                failures += self._load(slot, run, indices[first : last + 1], first)
        return bad

    def _check_outage(self, run: EpochRun) -> None:
        """Raise when this run's failures are an outage (``options.is_outage``), naming the first ones."""
        if not is_outage(len(run.failed), len(run.order), run.failed_batches):
            return
        first = "; ".join(f"{p!r}: {r}" for p, r in run.first_failures)
        raise WorkerError(f"on_error='skip' gave up: {len(run.failed)} of this rank's {len(run.order)} samples of "
                          f"epoch {run.epoch} failed so far, the last {run.failed_batches} batch(es) with none loaded; "
                          f"over {OUTAGE_FRACTION:.0%} of an epoch failing, or {OUTAGE_BATCHES} batches in a row, is an "
                          f"outage, not a few bad files. The first failures: {first}")

    def _load(self, slot: int, run: EpochRun, indices: list[int], start: int) -> list[Failure]:
        """Load ``indices`` into positions ``start...`` of ``slot`` now; their failures."""
        batch_id = next(run.slots.ids)
        self.pool.submit(batch_id, slot, run.seed, run.epoch, indices, start=start, size=run.size)
        return self.pool.collect(batch_id)[1]


def _move(view: SlotView, src: int, dst: int) -> None:
    """Copy sample ``src`` of a slot over sample ``dst``: its label, meta row and output, and what holds its
    image, no more: on the GPU path its encoded bytes (``KIND_BYTES``) or its decoded rows (``KIND_ROWS``), as
    many as its meta row says, or its pixels (``KIND_PIXELS``); on the CPU path its pixels."""
    for arr in (view.labels, view.meta, view.output):
        if arr is not None:
            arr[dst] = arr[src]
    kind = KIND_PIXELS if view.meta is None else view.meta[src, Meta.KIND]
    if kind == KIND_BYTES:
        length = view.meta[src, Meta.LENGTH]
        view.arena[dst, :length] = view.arena[src, :length]
    elif kind == KIND_ROWS:
        length = view.meta[src, Meta.LENGTH]
        view.rooms[dst, :length] = view.rooms[src, :length]
    else:
        view.images[dst] = view.images[src]


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as (first, last) runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and p == out[-1][1] + 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out
