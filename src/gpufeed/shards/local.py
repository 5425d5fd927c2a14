"""The local engine: worker processes on this machine prepare the inputs, this process writes the shards.

    this process: plan order ─► chunks of CHUNK inputs, at most IN_FLIGHT per worker submitted ─┐
    workers:      read + decode + resize/re-encode (Preparer) ◄──────────────────────────────────┘
    this process: results in order ─► write_shard (one shard at a time) ─► progress

The inputs of every shard go to all the workers, so a conversion into a few large shards keeps every
core busy. A file list goes to the workers once, in shared memory (``sources.shared``); a source read
whole group by group (remote shards, Parquet) is fetched ahead of the workers along the order and its
local copies deleted once passed (its ``readahead``), as the loader does. Workers exit as soon as this
process is gone, however it went (the loader's workers' rule, ``workers.process``).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterator, Sequence

import numpy as np

from ..sources.base import FileSource
from ..sources.shared import SharedFileSource
from ..workers.process import exit_with_parent, main_not_reimported
from .plan import probe_cost
from .prepare import Broken, Prepared, Preparer
from .shard import ShardJob, ShardRecord, write_shard

CHUNK = 16  # inputs per task: amortises the pipe round trip (~100 us) over ~16 decodes of ~1-5 ms
IN_FLIGHT = 4  # tasks per worker submitted ahead: a worker never waits for this process

_worker: tuple = ()  # in each worker: (source, preparer)


def _init(source, preparer: Preparer, parent_alive) -> None:
    global _worker
    _worker = (source, preparer)
    exit_with_parent(parent_alive)  # a worker left blocked on its task queue would hold the shared memory


def _prepare(pairs: list[tuple[int, int]]) -> list[Prepared | Broken]:
    source, preparer = _worker
    return [preparer(source, index, position) for index, position in pairs]


class LocalEngine:
    """``workers`` processes preparing inputs of ``source`` with ``preparer``."""

    def __init__(self, source, preparer: Preparer, workers: int) -> None:
        self.source, self.workers = source, workers
        self._block = None
        shipped = source
        if type(source) is FileSource:  # a subclass keeps its own read (the shared copy is a plain list)
            shipped, self._block = SharedFileSource.create(source)
        methods = mp.get_all_start_methods()  # forkserver: safe whatever threads this process runs
        context = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        alive, self._alive = context.Pipe(duplex=False)  # workers read; the write end stays here, and only here
        # the pool starts its processes as tasks come: the user's script is not re-run in them while it lives,
        # so a script converting at module level needs no __main__ guard
        self._main = contextlib.ExitStack()
        self._main.enter_context(main_not_reimported(type(source).__module__ == "__main__"))
        try:
            self._pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init,
                                             initargs=(shipped, preparer, alive))
        except BaseException:
            self._main.close()
            raise

    def probe(self, indices: np.ndarray, positions: np.ndarray, format: str) -> list[int]:
        return [probe_cost(s, format) for s in self._results(list(zip(indices.tolist(), positions.tolist())))]

    def write(self, job: ShardJob, shards: Sequence[int], progress: Callable[[int], None]) -> Iterator[ShardRecord]:
        """Make ``shards`` of the plan, yielding each one's record when it is published."""
        plan = job.plan
        positions = [p for k in shards for p in plan.positions(k)]
        results = self._results([(int(plan.order[p]), p) for p in positions], progress)
        try:
            for k in shards:
                yield write_shard(job, k, results)
        finally:
            results.close()

    def _results(self, pairs: list[tuple[int, int]], progress: Callable[[int], None] | None = None
                 ) -> Iterator[Prepared | Broken]:
        """The prepared inputs ``pairs`` (index, position), in order, a bounded window of them in flight."""
        readahead = getattr(self.source, "readahead", None)
        fetch = readahead([i for i, _ in pairs]) if readahead is not None else None
        chunks = [pairs[a:a + CHUNK] for a in range(0, len(pairs), CHUNK)]
        pending: collections.deque = collections.deque()  # futures, oldest first
        submitted = 0
        try:
            for chunk in chunks:
                while len(pending) >= IN_FLIGHT * self.workers:
                    yield from self._take(pending, progress)
                pending.append(self._pool.submit(_prepare, chunk))
                submitted += len(chunk)
                if fetch is not None:  # delivered: all but the chunks in flight (each CHUNK but the last)
                    fetch.at(submitted, max(0, submitted - CHUNK * len(pending)))
            while pending:
                yield from self._take(pending, progress)
        finally:
            for f in pending:
                f.cancel()
            if fetch is not None:
                fetch.close()

    @staticmethod
    def _take(pending: collections.deque, progress: Callable[[int], None] | None) -> Iterator[Prepared | Broken]:
        out = pending.popleft().result()
        if progress is not None:
            progress(len(out))
        yield from out

    def close(self) -> None:
        """Stop the workers and free what they shared, each step also when one before it fails."""
        with contextlib.ExitStack() as steps:  # run in reverse: the pool first, the main script's spec last
            steps.callback(self._main.close)
            steps.callback(self._alive.close)
            if self._block is not None:
                block, self._block = self._block, None
                steps.callback(block.unlink)
                steps.callback(block.close)
            self._pool.shutdown(wait=True, cancel_futures=True)
