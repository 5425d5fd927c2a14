"""Which inputs go to which shard, fixed before any shard is written, so every shard can be made on its
own (by any process or node, in any order, again after a kill) and comes out the same.

The order is the source's, or a permutation drawn from the shuffle seed; shard k takes inputs
``[k * per_shard, (k + 1) * per_shard)`` of it, less those that cannot be delivered (a shard left with
none is not written). A size in bytes sets ``per_shard`` from a probe: ``PROBE`` inputs spread evenly
over the order, prepared first, whose mean stored size divides the target. The plan's identity (options,
the source, its inputs' names and classes, inputs per shard) and its digest, the fingerprint, tell a
resumable conversion from another one; library versions are recorded in the manifest, not part of it, so an
upgrade does not orphan a conversion half done.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .options import ShardOptions
from .prepare import RESAMPLE, Broken, Prepared
from .writers import sample_bytes

PROBE = 256
PLAN_VERSION = 2  # 2: library versions left out of the identity


def order_of(n: int, seed: int | None) -> np.ndarray:
    """Position -> source index: the source's order, or a permutation drawn from ``seed``."""
    return np.arange(n, dtype=np.int64) if seed is None else np.random.default_rng(seed).permutation(n)


def probe_positions(n: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(n, PROBE)).round().astype(np.int64))


def probe_cost(sample: Prepared | Broken, format: str) -> int:
    """What a probed sample adds to its shard (a broken one nothing: shards lose them too)."""
    return sample_bytes(format, sample.data, sample.path) if isinstance(sample, Prepared) else 0


def per_shard_from(costs: Sequence[int], target_bytes: int) -> int:
    """Samples per shard for shards of about ``target_bytes``, from the probe's costs."""
    stored = sum(costs)
    return max(1, target_bytes * len(costs) // stored) if stored else max(1, len(costs))


@dataclass(frozen=True)
class Plan:
    """The order (position -> source index), ``per_shard`` inputs per shard, and the output options."""

    order: np.ndarray
    per_shard: int
    options: dict[str, Any]
    identity: dict[str, Any]  # what decides the shards (``identity``); its digest is the fingerprint
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        count = -(-len(self.order) // self.per_shard)
        width = max(6, len(str(count - 1)))
        ext = self.options["format"]
        object.__setattr__(self, "names", tuple(f"shard-{k:0{width}d}.{ext}" for k in range(count)))

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()

    def positions(self, k: int) -> range:
        return range(k * self.per_shard, min(len(self.order), (k + 1) * self.per_shard))

    def key(self, position: int) -> str:
        """A sample's key in its shard: its position in the order (digits only: no dots, unique)."""
        return f"{position:0{max(9, len(str(len(self.order))))}d}"


def output_options(options: ShardOptions, shuffle: int | None) -> dict[str, Any]:
    """The options that decide the shards' bytes (those the manifest records and the loader reports)."""
    return {"format": options.format, "max_side": options.max_side, "quality": options.quality,
            "resample": RESAMPLE if options.max_side is not None else None, "shard_size": str(options.shard_size),
            "shuffle": shuffle, "on_error": options.on_error, "max_bytes": options.max_bytes}


def make_plan(source, options: ShardOptions, shuffle: int | None, described: str,
              probe: Callable[[np.ndarray, np.ndarray, str], list[int]]) -> Plan:
    """The plan for ``source``; ``probe(indices, positions, format)`` gives the ``probe_cost`` of each of
    those inputs, when the size is in bytes."""
    n = len(source)
    order = order_of(n, shuffle)
    if options.shard_size.samples is not None:
        per_shard = options.shard_size.samples
    else:
        at = probe_positions(n)
        per_shard = per_shard_from(probe(order[at], at, options.format), options.shard_size.bytes)
    out = output_options(options, shuffle)
    return Plan(order, per_shard, out, identity(source, out, described, per_shard))


def identity(source, options: dict[str, Any], described: str, per_shard: int) -> dict[str, Any]:
    """What decides the shards: the options, the source and its inputs' names (a digest) in source order,
    its classes, and the plan."""
    names = hashlib.sha256()
    for i in range(len(source)):
        names.update(source.path(i).encode("utf-8", "surrogateescape") + b"\n")
    return {"plan": PLAN_VERSION, "options": options, "source": described, "inputs": len(source),
            "names": names.hexdigest(), "classes": list(getattr(source, "classes", ()) or ()),
            "per_shard": per_shard}


_SAID = {"plan": "the plan's layout", "source": "the source", "inputs": "the number of inputs",
         "names": "the inputs' file names", "classes": "the class names", "per_shard": "the inputs per shard"}


def differences(recorded: Any, ours: dict[str, Any]) -> str:
    """What differs between a recorded identity and ``ours``, in words: "max_side (320 there, 256 here)"."""
    if not isinstance(recorded, dict) or recorded.get("plan") != ours.get("plan"):
        return ("it was written by an older gpufeed, which recorded its conversion otherwise: delete it and "
                "convert again")
    said = []
    for k, v in ours.items():
        there = recorded.get(k)
        if k == "options" and isinstance(there, dict):
            said += [f"{o} ({there.get(o)!r} there, {w!r} here)" for o, w in v.items() if there.get(o) != w]
        elif there != v:
            show = k in ("source", "inputs", "per_shard")
            said.append(f"{_SAID.get(k, k)}" + (f" ({there!r} there, {v!r} here)" if show else ""))
    return ", ".join(said) or "nothing recorded differs"


def writer_versions() -> dict[str, str]:
    """The versions that decide the bytes written (Pillow's encoder and resampling, pyarrow's writer)."""
    import PIL

    from .. import __version__

    versions = {"gpufeed": __version__, "pillow": PIL.__version__}
    try:
        import pyarrow

        versions["pyarrow"] = pyarrow.__version__
    except ImportError:
        pass
    return versions
