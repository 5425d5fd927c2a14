"""The Ray engine: the same shards made by a Ray Data job, one shard per task, on the cluster
``ray.init()`` finds (``RAY_ADDRESS``, or the one ``ray start`` left on this machine) or a local one.

    driver:  plan ─► ray.data.from_items(one row per shard) ─► map_batches(ShardMaker, actor pool)
    actors:  source (once per actor, from the object store) ─► Preparer ─► write_shard ─► record row
    driver:  records as shards finish ─► progress ─► manifest

Each actor prepares a shard's inputs one after another and writes, publishes and records the shard
itself, so a driver that dies loses no finished shard. Inputs and the destination must be reachable from
every node under the same name: URLs, or a filesystem every node mounts. A source read whole group by
group fetches into a folder of the actor's own, emptied after each shard.
"""

from __future__ import annotations

import json
import shutil
from typing import Callable, Iterator, Sequence

import numpy as np

from .plan import probe_cost
from .prepare import Preparer
from .shard import BrokenInput, ShardJob, ShardRecord, write_shard

READ_AHEAD = 64  # inputs: how far ahead of the task a grouped source is fetched


def _ray():
    try:
        import ray
        import ray.data
    except ImportError:
        raise ImportError("engine='ray' needs Ray Data: pip install 'gpufeed[ray]'") from None
    return ray


class ShardMaker:
    """A Ray Data actor: rows ``{"shard": k}`` in, ``{"record": JSON}`` out; rows ``{"probe": JSON list of
    [index, position]}`` give ``{"costs": JSON list}``."""

    def __init__(self, source_ref: list, preparer: Preparer, job: ShardJob | None, format: str) -> None:
        ray = _ray()
        self.source, self.preparer, self.job, self.format = ray.get(source_ref[0]), preparer, job, format

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        if "probe" in batch:
            return {"costs": [json.dumps(self._probe(json.loads(p))) for p in batch["probe"]]}
        return {"record": [json.dumps(self._shard(int(k)).to_json(self.job.plan.fingerprint)) for k in batch["shard"]]}

    def _probe(self, pairs: list[list[int]]) -> list[int]:
        return [probe_cost(self.preparer(self.source, i, p), self.format) for i, p in pairs]

    def _shard(self, k: int) -> ShardRecord:
        plan = self.job.plan
        spool = _own_spool(self.source)
        positions = plan.positions(k)
        readahead = getattr(self.source, "readahead", None)
        fetch = readahead([int(plan.order[p]) for p in positions]) if readahead is not None else None

        def samples():
            for n, p in enumerate(positions):
                if fetch is not None:
                    fetch.at(min(len(positions), n + READ_AHEAD), n)
                yield self.preparer(self.source, int(plan.order[p]), p)

        try:
            return write_shard(self.job, k, samples())
        finally:
            if fetch is not None:
                fetch.close()
            if spool is not None:
                shutil.rmtree(spool, ignore_errors=True)


def _own_spool(source) -> str | None:
    """Give a source read through a spool a fresh folder of this process's (the driver's is on another
    machine, or shared by every actor); returns it, for deleting after the shard."""
    from ..sources.spool import Spool

    old = getattr(source, "spool", None)
    if not isinstance(old, Spool):
        return None
    source.spool = Spool(None, old.storage_options, old.retry, old.direct)
    return source.spool.root


class RayEngine:
    """``workers`` actors (None: the cluster's CPUs) preparing and writing shards of ``source``."""

    def __init__(self, source, preparer: Preparer, workers: int | None) -> None:
        ray = _ray()
        if not ray.is_initialized():
            ray.init()
        self.workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.preparer = preparer
        self._source_ref = [ray.put(source)]  # in a list: Ray passes it to the actors unresolved

    def _map(self, rows: list[dict], job: ShardJob | None, format: str):
        ray = _ray()
        ds = ray.data.from_items(rows, override_num_blocks=len(rows))
        return ds.map_batches(ShardMaker, batch_size=1, num_cpus=1,
                              compute=ray.data.ActorPoolStrategy(size=min(self.workers, len(rows))),
                              fn_constructor_kwargs={"source_ref": self._source_ref, "preparer": self.preparer,
                                                     "job": job, "format": format})

    def probe(self, indices: np.ndarray, positions: np.ndarray, format: str) -> list[int]:
        pairs = [[int(i), int(p)] for i, p in zip(indices, positions)]
        step = -(-len(pairs) // self.workers)
        rows = [{"probe": json.dumps(pairs[a:a + step])} for a in range(0, len(pairs), step)]
        costs = []
        with _job_settings(), _original_errors():
            for row in self._map(rows, None, format).iter_rows():  # in the rows' order (Ray Data keeps it)
                costs.extend(json.loads(row["costs"]))
        return costs

    def write(self, job: ShardJob, shards: Sequence[int], progress: Callable[[int], None]) -> Iterator[ShardRecord]:
        if not shards:
            return
        with _job_settings(), _original_errors():
            for row in self._map([{"shard": k} for k in shards], job, job.plan.options["format"]).iter_rows():
                record = ShardRecord.from_json(json.loads(row["record"]))
                progress(record.inputs)
                yield record

    def close(self) -> None:
        self._source_ref = []


class _job_settings:
    """Ray Data's settings for the conversion's jobs, the user's own restored after: no progress bars of its
    own (the conversion's counts images), and an actor's exception raised as itself."""

    SETTINGS = {"enable_progress_bars": False, "raise_original_map_exception": True}

    def __enter__(self) -> None:
        context = _ray().data.DataContext.get_current()
        self.saved = {k: getattr(context, k) for k in self.SETTINGS if hasattr(context, k)}
        for k, v in self.SETTINGS.items():
            setattr(context, k, v)

    def __exit__(self, *exc) -> None:
        context = _ray().data.DataContext.get_current()
        for k, v in self.saved.items():
            setattr(context, k, v)


class _original_errors:
    """Re-raise the BrokenInput an actor raised as itself, not wrapped in Ray's task errors."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        seen, e = 0, error
        while e is not None and seen < 16:
            if isinstance(e, BrokenInput):
                raise BrokenInput(e.path, e.reason) from None
            e = getattr(e, "cause", None) or e.__cause__
            seen += 1
        return False
