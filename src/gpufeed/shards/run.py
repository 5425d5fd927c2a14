"""``write_shards``: a source to shards and their manifest, through an engine, resuming what a destination
already holds of the same conversion."""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

from ..sources import Source, create_source
from ..sources.manifest import MANIFEST
from ..sources.urls import is_url, redact, unsigned
from .dest import Destination
from .manifest import PLAN_RECORD, build_manifest, changed_shards, destination_state
from .options import ShardOptions, default_shuffle, default_workers
from .plan import make_plan
from .prepare import Preparer
from .shard import FULL_ERRNOS, DestinationFull, ShardJob


def create_engine(options: ShardOptions, source, preparer: Preparer):
    if options.engine == "ray":
        from .ray_engine import RayEngine  # Ray only when asked for: the local engine never imports it

        return RayEngine(source, preparer, options.workers)
    from .local import LocalEngine

    return LocalEngine(source, preparer, options.workers or default_workers())


def write_shards(source: "str | os.PathLike | list[str] | Source", dest: str | os.PathLike, options: ShardOptions = ShardOptions(),
                 *, storage_options: dict[str, Any] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write ``source`` (anything ``create_source`` reads: a folder, a file list, tar shards, Parquet, URLs
    of these) as shards into ``dest`` (a folder or folder URL) with ``options``; returns the manifest
    (``shards.manifest``), also written as ``dest/manifest.json``. ``progress(done, total)``: inputs done
    of all, as they are (shards already there count as done).

    ``dest`` must be empty, or hold this same conversion (same inputs and options; a refusal names what differs),
    unfinished (its missing shards are made; finished ones are kept) or finished (nothing is done).
    ``storage_options`` go to fsspec for source and destination URLs."""
    if options.format == "parquet":  # before anything is read or written
        from ..sources.parquet import require_pyarrow

        require_pyarrow("writing Parquet shards")
    if isinstance(source, (str, os.PathLike)) and not is_url(str(source)):
        source = os.path.abspath(source)  # the same conversion from any working folder
    src = create_source(source, storage_options=storage_options)
    described = describe(source)
    shuffle = default_shuffle(src) if options.shuffle == "auto" else options.shuffle
    destination = Destination(str(dest), dict(storage_options or {}))
    preparer = Preparer(max_side=options.max_side, quality=options.quality, max_bytes=options.max_bytes)
    with destination.held(owner={"source": described}) as hold:  # one conversion per destination at a time
        engine = create_engine(options, src, preparer)
        try:
            plan = make_plan(src, options, shuffle, described, engine.probe)
            return _convert(src, source, plan, destination, engine, options, described, progress, hold)
        finally:
            engine.close()


NAMED = 10  # changed shards a rerun's warning names, so that one over thousands stays a line a person reads


def _convert(src, source, plan, destination: Destination, engine, options: ShardOptions, described: str,
             progress: Callable[[int, int], None] | None, hold) -> dict[str, Any]:
    """The plan's shards into a destination this process holds (``hold.check()`` raises once it does not):
    those not there yet, then the manifest."""
    state = destination_state(destination, plan)
    if state.manifest is not None:  # done already: nothing read or written again
        return state.manifest
    if state.changed:
        named = "; ".join(state.changed[:NAMED]) + (f"; and {len(state.changed) - NAMED} more (`gpufeed shards "
                                                     f"--verify` lists them)" if len(state.changed) > NAMED else "")
        warnings.warn(f"gpufeed shards: {redact(destination.root)}: {len(state.changed)} shard(s) of the finished "
                      f"conversion are not as its manifest lists them, so they are made anew: {named}", stacklevel=3)
    hold.check()  # planning may have taken long
    destination.prepare()
    destination.remove(state.stale)
    destination.write_json(PLAN_RECORD, {"fingerprint": plan.fingerprint, "identity": plan.identity})
    classes = tuple(getattr(src, "classes", ()) or ())
    job = ShardJob(plan, destination, classes, source if isinstance(source, str) else None, options.on_error,
                   hold.token)
    records = dict(state.done)
    tell = _Progress(progress, len(plan.order), sum(r.inputs for r in records.values()))
    todo = [k for k in range(len(plan.names)) if k not in records]
    try:
        for record in engine.write(job, todo, tell):
            records[record.index] = record
            hold.check()
        hold.check()
        manifest = build_manifest(plan, [records[k] for k in sorted(records)], classes, described)
        destination.write_json(MANIFEST, manifest)
    except OSError as e:
        if e.errno not in FULL_ERRNOS:
            raise
        raise DestinationFull(e.errno, f"{redact(destination.root)}: {os.strerror(e.errno)} while writing the "
                              "shards: make room there and run the same command again (the shards finished so "
                              "far are kept)") from None
    destination.remove_progress([job.record_name(k) for k in records] + [PLAN_RECORD])
    return manifest


def verify_shards(dest: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Every shard of the finished conversion in ``dest`` against its manifest (size and sha256, each shard
    read through once): what differs, one line a shard (empty: all as written). ValueError when ``dest``
    holds no manifest."""
    destination = Destination(str(dest), dict(storage_options or {}))
    manifest = destination.read_json(MANIFEST)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise ValueError(f"{redact(destination.root)} holds no {MANIFEST} of a finished `gpufeed shards` "
                         "conversion: nothing to verify (an unfinished one is finished by running it again)")
    return changed_shards(destination, manifest)


class _Progress:
    """The engines' "n more inputs done" as the caller's ``progress(done, total)``."""

    def __init__(self, progress: Callable[[int, int], None] | None, total: int, done: int) -> None:
        self.progress, self.total, self.done = progress, total, done
        self(0)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def describe(source: "str | os.PathLike | Source") -> str:
    """The source as the manifest names it: its path, or its URL without credentials or query."""
    if isinstance(source, (list, tuple)):
        return " ".join(describe(s) for s in source)
    if isinstance(source, (str, os.PathLike)):
        return unsigned(str(source))
    return f"<{type(source).__name__} of {len(source)} samples>"
