"""The manifest a conversion leaves beside its shards (``manifest.json``), and what a destination already
holds of a conversion (to resume it).

The manifest: ``gpufeed_shards`` (its layout's version), ``format``, ``inputs``, ``samples``, ``resized``,
``classes``, ``labels`` (samples per label), ``options`` (those that decide the bytes), ``source``,
``fingerprint``, ``written_with`` (library versions), ``shards`` (name, size, samples, sha256, and a
Parquet file's ``row_groups``, in order), ``broken`` (path, reason, shard: every input left out). It
holds no time and nothing of the engine, so the same conversion gives the same manifest.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Sequence

from ..sources.urls import redact
from ..sources.manifest import FORMAT_KEY, FORMAT_VERSION, MANIFEST, PLAN_RECORD, PROGRESS
from .dest import TEMP_SUFFIX, Destination
from .plan import Plan, differences, writer_versions
from .shard import ShardRecord



def build_manifest(plan: Plan, records: Sequence[ShardRecord], classes: Sequence[str], source: str) -> dict[str, Any]:
    labels: collections.Counter[str] = collections.Counter()
    for r in records:
        labels.update(r.labels)
    written = [r for r in records if r.samples]
    return {
        FORMAT_KEY: FORMAT_VERSION, "format": plan.options["format"], "inputs": len(plan.order),
        "samples": sum(r.samples for r in records), "resized": sum(r.resized for r in records),
        "classes": list(classes), "labels": dict(sorted(labels.items(), key=lambda kv: int(kv[0]))),
        "options": plan.options, "source": source, "fingerprint": plan.fingerprint, "identity": plan.identity,
        "written_with": writer_versions(),
        "shards": [{"name": r.name, "size": r.size, "samples": r.samples, "sha256": r.sha256,
                    **({"row_groups": r.row_groups} if r.row_groups else {})} for r in written],
        "broken": [{"path": p, "reason": why, "shard": r.name} for r in records for p, why in r.broken],
    }


@dataclass(frozen=True)
class DestinationState:
    """What a destination holds of the conversion with this plan: shards done (their records), or all of
    it (``manifest``: the finished conversion's, else None); ``stale``: leftover temporary files to delete;
    ``changed``: the finished conversion's shards that are not as its manifest lists them (``changed_shards``),
    to be made anew."""

    done: dict[int, ShardRecord]
    manifest: dict | None
    stale: list[str]
    changed: tuple[str, ...] = ()


def destination_state(dest: Destination, plan: Plan) -> DestinationState:
    """Raises ValueError naming the destination when it holds anything but this conversion."""
    listing = dest.listing()
    stale = [n for n in listing if n.endswith(TEMP_SUFFIX)]
    ours = {n for n in listing if n.startswith(PROGRESS + "/")} | set(stale)
    foreign = sorted(n for n in listing if n not in ours)
    manifest = dest.read_json(MANIFEST) if MANIFEST in listing else None
    if manifest is not None:
        if not isinstance(manifest, dict) or manifest.get("fingerprint") != plan.fingerprint:
            what = differences(manifest.get("identity") if isinstance(manifest, dict) else None, plan.identity)
            raise ValueError(f"{redact(dest.root)} holds the shards of another conversion (what differs: {what}): "
                             "give an empty destination, or delete it first")
    changed: list[str] = []
    if manifest is not None:
        changed = changed_shards(dest, manifest, listing)
        if not changed:  # every byte as the manifest's checksums say
            return DestinationState({}, manifest, stale)
        foreign = []  # a shard of it missing or changed: made again, the same bytes
    plan_doc = dest.read_json(PLAN_RECORD) if PLAN_RECORD in listing else None
    if plan_doc is not None and plan_doc.get("fingerprint") != plan.fingerprint:
        what = differences(plan_doc.get("identity"), plan.identity)
        raise ValueError(f"{redact(dest.root)} holds an unfinished conversion of other inputs or options (what "
                         f"differs: {what}): resume it with those, or give an empty destination, or delete it first")
    if plan_doc is None:
        foreign = [n for n in foreign if n != MANIFEST]
        if foreign:
            raise ValueError(f"{redact(dest.root)} is not empty (it holds {foreign[0]!r}): give an empty destination")
    return DestinationState(_done(dest, plan, listing), None, stale, tuple(changed))


def changed_shards(dest: Destination, manifest: dict, listing: dict[str, int] | None = None) -> list[str]:
    """The shards of a finished conversion that are not as its manifest lists them, each said with what
    differs: missing, another size, or another sha256 (each shard read through once)."""
    listing = dest.listing() if listing is None else listing
    found = []
    for s in manifest.get("shards", []):
        name, size, sha = s.get("name"), s.get("size"), s.get("sha256")
        if name not in listing:
            found.append(f"{name}: missing")
        elif listing[name] != size:
            found.append(f"{name}: {listing[name]} bytes where the manifest has {size}")
        else:
            held = dest.digest(name)
            if held is None:
                found.append(f"{name}: missing")
            elif held[1] != sha:
                found.append(f"{name}: its sha256 is not the manifest's (changed since it was written)")
    return found


def _done(dest: Destination, plan: Plan, listing: dict[str, int]) -> dict[int, ShardRecord]:
    """The shards whose record this plan wrote and whose file is there at the recorded size."""
    done = {}
    for k, name in enumerate(plan.names):
        if f"{PROGRESS}/{name}.json" not in listing:
            continue
        doc = dest.read_json(f"{PROGRESS}/{name}.json")
        if not isinstance(doc, dict) or doc.get("fingerprint") != plan.fingerprint:
            continue
        try:
            record = ShardRecord.from_json(doc)
        except (KeyError, TypeError):  # not a record this version wrote: the shard is made again
            continue
        if record.index == k and (record.samples == 0 or listing.get(name) == record.size):
            done[k] = record
    return done
