"""Epoch order, rank shards and a resumable position that does not depend on the world size.

The order of epoch ``e`` is ``torch.randperm(n, generator=seed + e)``, then padded or truncated to a
multiple of ``world_size`` and strided by rank, exactly as ``torch.utils.data.DistributedSampler`` does, so
a run that swaps its DataLoader for gpufeed sees the same samples on the same ranks.

    full order  [7 2 9 4 0 5 1 8 3 6]      (seed, epoch)
    rank 0 of 2  7 . 9 . 0 . 1 . 3 .  ->  [7 9 0 1 3]
    rank 1 of 2  . 2 . 4 . 5 . 8 . 6  ->  [2 4 5 8 6]

Position. Ranks that train together (DDP) deliver their batches in lockstep, and a batch always takes its
full count of entries from the rank's order (a sample that cannot be loaded is replaced within its batch,
not by the next entry), so after p samples per rank the epoch's first ``p x world_size`` entries of the
full order are delivered, whichever rank holds them. ``state_dict()`` records that count (``offset``), the
same on every rank; ``load_state_dict`` on any world size continues with the rest of the full order,
sharded over the new ranks the same way (elastic resume):

    saved on 3 ranks after 2 samples each: offset 6  ->  [7 2 9 4 0 5 | 1 8 3 6]
    resumed on 2 ranks: rank 0 gets [1 3], rank 1 gets [8 6]

A resumed epoch delivers every entry the epoch would have delivered as it was begun (its world size and
batch size, ``begun``), and nothing it would have dropped: the rest is filled up to whole batches on every
new rank (without ``drop_last``: to one sample each) with its own first entries, as ``DistributedSampler``
pads, so no sample of the epoch is lost, none is repeated but those, and every rank yields the same number
of full batches.

Grouped order. A source read whole group by group (remote tar shards, Parquet row groups) gives its
groups' sizes, and each rank should read only its own groups (a remote shard is fetched by every rank
that reads any of its samples). The groups are shuffled into a line and the line's samples are cut into
``world_size`` runs of equal length (``n // world_size``, the first ``n % world_size`` runs one longer), run r
for rank r; within each run, the samples of each ``window`` consecutive groups are shuffled together, so
the workers need only a few groups at a time. The full order then puts entry k of run r at position
``k * world_size + r``, so the usual striding hands rank r exactly its run:

    groups [0 1 2] [3 4] [5 6 7] [8 9], window 2, 2 ranks, group order (2 0 3 1)
    line        5 6 7 0 1 | 2 8 9 3 4      cut into runs of 5 (group 0 is split: both ranks read it)
    runs        [6 0 5 1 7] [9 2 8 4 3]    windows shuffled: {5 6 7, 0 1} | {2, 8 9} {3 4}
    full order  [6 9 0 2 5 8 1 4 7 3]      rank 0 gets [6 0 5 1 7], rank 1 [9 2 8 4 3]

So a rank reads about ``1 / world_size`` of the groups: those of its run, whose two end groups it may share
with its neighbours, and (when ``world_size`` does not divide n) the one holding its padding sample,
another rank's first. ``units`` keeps consecutive groups together on the line (a remote Parquet file's row
groups: a rank fetches its files once). The order is a function of (seed, epoch, world size); with one rank
it is the groups shuffled, then the samples within each window of that order. A state records the world
size its epoch's order was made for: a resume on another continues the rest of that order strided over the
new ranks, exact, but each rank then reads groups of others for the rest of that epoch; the next epoch is
dealt to the new ranks. Unshuffled (``shuffle=False``), the line is the groups in index order, not shuffled,
cut the same way.

Saved states are checked before anything is taken from them (``check_loader_state``, and the sampler's own
fields in ``load_state_dict``): a format ``version`` (``STATE_VERSION``; none: the unversioned format
that came before), the source's fingerprint (its sample count and a digest of its paths or URLs and
labels, ``sources.base.fingerprint``), the keys and each value's type. What does not match raises a
``ValueError`` naming it; a state of another seed is taken with its seed (the rest of its order), and
says so in a warning.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .options import is_integer

__all__ = ["STATE_VERSION", "ShardedSampler", "check_loader_state", "launcher_env", "local_world_size", "resolve_rank"]

_log = logging.getLogger("gpufeed")

STATE_VERSION = 1  # ImageLoader.state_dict()'s format; a state of a later one is refused
# the keys of a loader's state and their types; "version" and "source" from version 1 on
_LOADER_KEYS = {"version": int, "source": dict, "sampler": dict, "batch_size": int, "image_size": int,
                "resize_size": int}
# the sampler's keys: those always there, and those only some states have
_SAMPLER_NEEDS = ("epoch", "seed", "num_samples_total", "world_size")
_SAMPLER_MAY = ("offset", "position", "groups", "order_world_size", "begun")


def check_loader_state(state: object, fingerprint: Mapping[str, Any]) -> int:
    """Check a loader's saved ``state`` against this loader's source ``fingerprint`` ({"samples", "digest"}):
    its version, keys and types, and that it was saved over the same source. Raises ``ValueError`` naming
    what does not match; returns the state's version (0: saved before states had one, whose source cannot
    be checked: a warning says so)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict must be a dict (ImageLoader.state_dict()), got {type(state).__name__}")
    version = state.get("version", 0)
    if not is_integer(version) or version < 0:
        raise ValueError(f"state_dict['version'] must be an integer >= 0, got {version!r}")
    if version > STATE_VERSION:
        raise ValueError(f"state_dict has format version {version}; this gpufeed reads versions up to "
                         f"{STATE_VERSION}: it was saved by a newer gpufeed")
    needed = ["sampler"] + (["version", "source"] if version >= 1 else [])
    missing = [k for k in needed if k not in state]
    if missing:
        raise ValueError(f"state_dict lacks {', '.join(map(repr, missing))} (keys: {sorted(map(str, state))}): "
                         "give it a whole ImageLoader.state_dict()")
    unknown = sorted(str(k) for k in state if k not in _LOADER_KEYS)
    if unknown:
        raise ValueError(f"state_dict has keys this gpufeed does not know: {', '.join(map(repr, unknown))}")
    for key, kind in _LOADER_KEYS.items():
        if key in state and not (isinstance(state[key], kind) and not isinstance(state[key], bool)):
            raise ValueError(f"state_dict[{key!r}] must be {'an integer' if kind is int else 'a dict'}, "
                             f"got {state[key]!r}")
    if version == 0:
        _log.warning("gpufeed: this state_dict has no format version (an older gpufeed saved it): whether it was "
                     "saved over the same data cannot be checked")
        return version
    saved = state["source"]
    if saved != dict(fingerprint):
        raise ValueError(f"state_dict was saved over another source: {saved.get('samples')!r} samples, digest "
                         f"{saved.get('digest')!r}; this loader's source has {fingerprint['samples']} samples, digest "
                         f"{fingerprint['digest']!r} (a digest of its paths or URLs and labels): resume over the "
                         "data the state was saved with")
    return version


def launcher_env() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, ranks on this node) from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); None outside a launcher. The one place it is read."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return int(env["RANK"]), world, int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", world))


def local_world_size(world_size: int) -> int:
    """The ranks on this node (they share its cores): the launcher's ``LOCAL_WORLD_SIZE``, else all of them."""
    launched = launcher_env()
    return launched[3] if launched is not None else max(1, world_size)


def process_group() -> tuple[int, int] | None:
    """(rank, world size) of the initialised ``torch.distributed`` process group; None without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Fill ``rank``/``world_size`` from ``torch.distributed`` when initialised (``process_group``), else
    from torchrun's environment (``launcher_env``: a loader made before ``init_process_group`` still gets its
    shard), else (0, 1)."""
    group = process_group()
    # torchrun's environment only when neither is given: one given alone means a sharding of the caller's own
    launched = launcher_env() if rank is None and world_size is None else None
    found = group or (launched[:2] if launched else (0, 1))
    if world_size is None:
        world_size = found[1]
    if rank is None:
        rank = found[0]
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


def grouped_order(groups: Sequence[int], window: int, world_size: int, g: torch.Generator | None,
                  units: Sequence[int] | None = None) -> list[int]:
    """A permutation of ``range(sum(groups))`` whose entries ``r, r + world_size, ...`` lie in a run of
    about ``1 / world_size`` of the groups (module docstring, "Grouped order").

    ``units``: how many consecutive groups stay together (a file's row groups), default one each; ``g``:
    the shuffling generator, None for the groups in index order and no shuffle.
    """
    sizes = np.asarray(groups, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    n = int(starts[-1])
    per_unit = np.ones(len(sizes), np.int64) if units is None else np.asarray(units, np.int64)
    first_group = np.concatenate([[0], np.cumsum(per_unit)])
    unit_order = torch.randperm(len(per_unit), generator=g).numpy() if g is not None else np.arange(len(per_unit))
    line_groups = np.concatenate([np.arange(first_group[u], first_group[u + 1]) for u in unit_order])
    line_sizes = sizes[line_groups]
    bounds = np.concatenate([[0], np.cumsum(line_sizes)])  # where each group begins on the line, and its end
    # the line: the groups' samples one after another, in the units' order
    line = np.repeat(starts[line_groups] - bounds[:-1], line_sizes) + np.arange(n)
    q, extra = divmod(n, world_size)
    ranks = np.arange(world_size + 1)
    cuts = ranks * q + np.minimum(ranks, extra)  # rank r's run: [cuts[r], cuts[r + 1]); the first `extra` one longer
    if g is not None:
        for r in range(world_size):
            lo, hi = int(cuts[r]), int(cuts[r + 1])
            # the run's pieces of groups (its end groups may be parts), a window of them at a time
            edges = [lo] + bounds[np.searchsorted(bounds, lo, "right") : np.searchsorted(bounds, hi)].tolist() + [hi]
            for w in range(0, len(edges) - 1, window):
                a, b = edges[w], edges[min(w + window, len(edges) - 1)]
                line[a:b] = line[a:b][torch.randperm(b - a, generator=g).numpy()]
    # entry k of rank r's run goes to position k * world_size + r of the full order
    rank = np.repeat(ranks[:-1], np.diff(cuts))
    order = np.empty(n, np.int64)
    order[(np.arange(n) - cuts[rank]) * world_size + rank] = line
    return order.tolist()


@dataclass
class ShardedSampler:
    """Sample indices for one rank, one epoch at a time, resumable mid-epoch on any world size.

    ``drop_last`` as in ``DistributedSampler``: True drops the tail so every rank gets the same count
    (``n // world_size`` from an epoch's start); False pads with the first entries of the order so every
    rank gets ``ceil(n / world_size)``. ``start``: entries of the epoch's full order delivered before this
    rank's shard was cut (a resumed epoch); ``position``: samples of the shard handed out since;
    ``order_world_size``: the world size a grouped order of the current epoch was made for (a state saved on
    another; None: this one). ``batch_size``: samples per batch on each rank (a resumed epoch is filled up to
    whole batches); ``begun``: (world size, batch size) the current epoch was begun with (None: these).
    """

    num_samples_total: int
    shuffle: bool = True
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    epoch: int = 0
    position: int = 0
    start: int = 0
    groups: tuple[int, ...] | None = None  # sizes of consecutive index groups: a grouped order (module docstring)
    window: int = 4
    units: tuple[int, ...] | None = None  # groups kept together, e.g. per file (None: one each)
    order_world_size: int | None = None
    batch_size: int = 1
    begun: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.num_samples_total < 1:
            raise ValueError(f"the dataset has no samples (num_samples_total={self.num_samples_total})")
        if self.drop_last and self.num_samples_total < self.world_size:
            raise ValueError(
                f"drop_last=True leaves no sample per rank: {self.num_samples_total} samples, "
                f"world_size={self.world_size}"
            )
        if self.groups is not None and sum(self.groups) != self.num_samples_total:
            raise ValueError(f"groups hold {sum(self.groups)} samples, num_samples_total={self.num_samples_total}")
        if self.groups is not None and min(self.groups) < 1:
            raise ValueError(f"groups must be sizes >= 1, got {min(self.groups)} for group "
                             f"{list(self.groups).index(min(self.groups))}")
        if self.units is not None and (self.groups is None or sum(self.units) != len(self.groups)
                                       or min(self.units, default=0) < 1):
            raise ValueError(f"units must be counts >= 1 of consecutive groups adding up to the "
                             f"{len(self.groups or ())} groups, got {self.units}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def __len__(self) -> int:
        """Samples per epoch on this rank, from an epoch's start."""
        return self._shard_length(self.num_samples_total)

    def _shard_length(self, n: int) -> int:
        return n // self.world_size if self.drop_last else math.ceil(n / self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (a resumed position is kept if it is the same epoch)."""
        if epoch != self.epoch:
            self.restart(epoch)

    def restart(self, epoch: int | None = None) -> None:
        """``epoch`` (default: the current one) from its beginning, whatever position it stood at."""
        self.epoch = self.epoch if epoch is None else epoch
        self.position, self.start, self.order_world_size, self.begun = 0, 0, None, None

    @property
    def at_epoch_start(self) -> bool:
        """Whether the current epoch is the one a fresh sampler of this world size would give, from its start."""
        return self.position == 0 and self.start == 0 and self.order_world_size in (None, self.world_size)

    def full_order(self, epoch: int | None = None) -> list[int]:
        """The whole order of ``epoch`` (default: the current one) over all ranks, before padding: a
        permutation of the sample indices."""
        e = self.epoch if epoch is None else epoch
        g = None
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + e)
        if self.groups is None:
            n = self.num_samples_total
            return torch.randperm(n, generator=g).tolist() if g is not None else list(range(n))
        world = self.order_world_size if e == self.epoch and self.order_world_size else self.world_size
        return grouped_order(self.groups, self.window, world, g, self.units)

    def epoch_indices(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of ``epoch`` (default: the current one, from where it was resumed), in order."""
        e = self.epoch if epoch is None else epoch
        order = self.full_order(e)
        if e == self.epoch and self.start:
            return self._rest(order)
        total = self._shard_length(len(order)) * self.world_size
        if total > len(order):
            pad = total - len(order)
            order += (order * math.ceil(pad / len(order)))[:pad]
        else:
            order = order[:total]
        return order[self.rank : total : self.world_size]

    def _rest_bounds(self) -> tuple[int, int]:
        """(end of the resumed epoch as begun, entries each rank gets of its rest, padding included)."""
        n = self.num_samples_total
        world, batch = self.begun or (self.world_size, self.batch_size)
        end = (n // (world * batch)) * world * batch if self.drop_last else n
        step = self.world_size * (self.batch_size if self.drop_last else 1)
        rest = max(0, end - self.start)
        return end, -(-rest // step) * step // self.world_size

    def _rest(self, order: list[int]) -> list[int]:
        """This rank's share of a resumed epoch's rest (module docstring)."""
        end, per_rank = self._rest_bounds()
        rest = order[self.start : end]
        pad = per_rank * self.world_size - len(rest)
        rest += (rest * -(-pad // len(rest)))[:pad] if pad > 0 else []  # padded with its own first entries
        return rest[self.rank :: self.world_size]

    def remaining(self) -> list[int]:
        """The indices of this epoch not yet handed out, in order."""
        return self.epoch_indices()[self.position :]

    def advance(self, count: int) -> None:
        """Record that ``count`` more samples reached the consumer."""
        self.position += count

    @property
    def offset(self) -> int:
        """Entries of the epoch's full order delivered by all ranks (assuming they are in lockstep); the
        whole epoch once this rank's shard is done."""
        shard = self._rest_bounds()[1] if self.start else len(self)
        if self.position >= shard:
            return self.num_samples_total
        return self.start + self.position * self.world_size

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "seed": self.seed, "offset": self.offset,
                 "num_samples_total": self.num_samples_total, "world_size": self.world_size,
                 "begun": list(self.begun or (self.world_size, self.batch_size))}
        if self.groups is not None:  # the order depends on them and on the world size it was made for
            state["groups"] = self._grouping()
            state["order_world_size"] = self.order_world_size or self.world_size
        return state

    def _grouping(self) -> dict[str, Any]:
        """What a grouped order depends on besides the seed and world size: the groups' sizes (as a digest),
        the window, and the units (as a digest, when given)."""
        def digest(values: tuple[int, ...]) -> str:
            return hashlib.sha1(np.asarray(values, np.int64).tobytes()).hexdigest()[:16]

        grouping = {"count": len(self.groups), "sizes": digest(self.groups), "window": self.window}
        if self.units is not None:
            grouping["units"] = digest(self.units)
        return grouping

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``, saved on any world size (the dataset size must match). A grouped order
        continues as the order of the world size it was made for (``order_world_size``; a state that does
        not record it holds the order made for one rank), so after a resume on another world size the ranks
        fetch shards they do not own for the rest of that epoch; the next epoch is dealt to the new ranks. A
        state from before ``offset`` existed (``position`` per rank) needs the same world size. Its keys and
        types are checked first (``ValueError`` naming the first that is wrong); another seed's state is
        taken with its seed, and a warning says so."""
        _check_sampler_state(state)
        if state["num_samples_total"] != self.num_samples_total:
            raise ValueError(f"state_dict has num_samples_total={state['num_samples_total']}, "
                             f"this loader has {self.num_samples_total}")
        mine = self._grouping() if self.groups is not None else None
        saved = state.get("groups")
        if saved != mine:
            differ = sorted(k for k in {**(saved or {}), **(mine or {})} if (saved or {}).get(k) != (mine or {}).get(k))
            raise ValueError(f"state_dict was saved with a grouped order of {saved}, this loader's is {mine} "
                             f"(they differ in {', '.join(differ)}: the same source, window and units are needed "
                             "to resume)")
        order_world = state.get("order_world_size", 1) if self.groups is not None else None
        if order_world is not None and (not isinstance(order_world, int) or order_world < 1):
            raise ValueError(f"state_dict order_world_size must be an integer >= 1, got {order_world!r}")
        if "offset" in state:
            offset = state["offset"]
            if not 0 <= offset <= self.num_samples_total:
                raise ValueError(f"state_dict offset must be in [0, {self.num_samples_total}], got {offset}")
            start, position = offset, 0
        else:
            if state["world_size"] != self.world_size:
                raise ValueError(f"state_dict has world_size={state['world_size']} and no offset (an older "
                                 f"format), this loader has {self.world_size}")
            if not 0 <= state["position"] <= len(self):
                raise ValueError(f"state_dict position must be in [0, {len(self)}], got {state['position']}")
            start, position = 0, state["position"]
        begun = state.get("begun", [state["world_size"], self.batch_size])
        if not (isinstance(begun, (list, tuple)) and len(begun) == 2
                and all(isinstance(v, int) and v >= 1 for v in begun)):
            raise ValueError(f"state_dict begun must be [world size, batch size], integers >= 1, got {begun!r}")
        if state["seed"] != self.seed:
            _log.warning("gpufeed: the state_dict was saved with seed=%d, this loader was made with seed=%d: it goes "
                         "on with seed %d, the order the state was saved in", state["seed"], self.seed, state["seed"])
        self.seed, self.epoch, self.start, self.position = state["seed"], state["epoch"], start, position
        # nothing of the epoch delivered yet: it is begun here, on these ranks, in their own order
        fresh = start == position == 0
        self.begun = None if fresh or tuple(begun) == (self.world_size, self.batch_size) else tuple(begun)
        self.order_world_size = None if order_world == self.world_size or fresh else order_world


def _check_sampler_state(state: object) -> None:
    """``ValueError`` naming the first key of a sampler's saved ``state`` that is missing, unknown or of the
    wrong type."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict['sampler'] must be a dict, got {type(state).__name__}")
    missing = [k for k in _SAMPLER_NEEDS if k not in state]
    if "offset" not in state and "position" not in state:
        missing.append("offset")
    if missing:
        raise ValueError(f"state_dict['sampler'] lacks {', '.join(map(repr, missing))}")
    unknown = sorted(str(k) for k in state if k not in _SAMPLER_NEEDS + _SAMPLER_MAY)
    if unknown:
        raise ValueError(f"state_dict['sampler'] has keys this gpufeed does not know: {', '.join(map(repr, unknown))}")
    for key, value in state.items():
        if key == "groups":
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"state_dict['sampler']['groups'] must be a dict, got {value!r}")
        elif key != "begun" and not is_integer(value):  # begun: a pair, checked where it is read
            raise ValueError(f"state_dict['sampler'][{key!r}] must be an integer, got {value!r}")
    if state["epoch"] < 0 or state["world_size"] < 1:
        raise ValueError(f"state_dict['sampler'] needs epoch >= 0 and world_size >= 1, got epoch={state['epoch']}, "
                         f"world_size={state['world_size']}")
