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

Grouped order. A source read whole shard by shard (remote tar shards, Parquet row groups) gives its
groups' sizes; the order then shuffles the groups, and the samples within each ``window`` of consecutive
groups of that order, so the workers need only a few groups at a time. Still a function of (seed, epoch),
cut into rank shards and resumed exactly as above:

    groups [0 1 2] [3 4] [5 6 7] [8 9], window 2, group order (2 0 3 1)
    full order  [6 1 5 0 2 7 | 9 4 8 3]      (samples of groups 2 and 0 shuffled, then of 3 and 1)
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["ShardedSampler", "resolve_rank"]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Fill ``rank``/``world_size`` from ``torch.distributed`` when initialised, else from torchrun's
    ``RANK``/``WORLD_SIZE`` environment (a loader made before ``init_process_group`` still gets its shard),
    else (0, 1)."""
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    # torchrun's environment only when neither is given: one given alone means a sharding of the caller's own
    env = rank is None and world_size is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if world_size is None:
        world_size = dist.get_world_size() if initialised else int(os.environ["WORLD_SIZE"]) if env else 1
    if rank is None:
        rank = dist.get_rank() if initialised else int(os.environ["RANK"]) if env else 0
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


def grouped_order(groups: tuple[int, ...], window: int, g: torch.Generator) -> list[int]:
    """A permutation of ``range(sum(groups))``: groups in random order, samples shuffled within each run of
    ``window`` consecutive groups of that order."""
    starts = [0]
    for size in groups:
        starts.append(starts[-1] + size)
    perm = torch.randperm(len(groups), generator=g).tolist()
    out: list[torch.Tensor] = []
    for w in range(0, len(perm), window):
        idx = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in perm[w : w + window]])
        out.append(idx[torch.randperm(len(idx), generator=g)])
    return torch.cat(out).tolist()


@dataclass
class ShardedSampler:
    """Sample indices for one rank, one epoch at a time, resumable mid-epoch on any world size.

    ``drop_last`` as in ``DistributedSampler``: True drops the tail so every rank gets the same count
    (``n // world_size`` from an epoch's start); False pads with the first entries of the order so every
    rank gets ``ceil(n / world_size)``. ``start``: entries of the epoch's full order delivered before this
    rank's shard was cut (a resumed epoch); ``position``: samples of the shard handed out since.
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
            self.epoch, self.position, self.start = epoch, 0, 0

    @property
    def at_epoch_start(self) -> bool:
        return self.position == 0 and self.start == 0

    def epoch_indices(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of ``epoch`` (default: the current one, from where it was resumed), in order."""
        e = self.epoch if epoch is None else epoch
        n = self.num_samples_total
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + e)
            if self.groups is None:
                order = torch.randperm(n, generator=g).tolist()
            else:
                order = grouped_order(self.groups, self.window, g)
        else:
            order = list(range(n))
        if e == self.epoch:
            order = order[self.start :]
        total = self._shard_length(len(order)) * self.world_size
        if total > len(order):
            pad = total - len(order)
            order += (order * math.ceil(pad / len(order)))[:pad]
        else:
            order = order[:total]
        return order[self.rank : total : self.world_size]

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
        rest = self.num_samples_total - self.start
        if self.position >= self._shard_length(rest):
            return self.num_samples_total
        return self.start + self.position * self.world_size

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "seed": self.seed, "offset": self.offset,
                 "num_samples_total": self.num_samples_total, "world_size": self.world_size}
        if self.groups is not None:  # the order depends on them: a resume must see the same
            state["groups"] = self._grouping()
        return state

    def _grouping(self) -> dict[str, Any]:
        """What a grouped order depends on besides the seed: the groups' sizes (as a digest) and the window."""
        digest = hashlib.sha1(np.asarray(self.groups, np.int64).tobytes()).hexdigest()[:16]
        return {"count": len(self.groups), "sizes": digest, "window": self.window}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``, saved on any world size (the dataset size must match). A state from before
        ``offset`` existed (``position`` per rank) needs the same world size."""
        if state["num_samples_total"] != self.num_samples_total:
            raise ValueError(f"state_dict has num_samples_total={state['num_samples_total']}, "
                             f"this loader has {self.num_samples_total}")
        mine = self._grouping() if self.groups is not None else None
        if state.get("groups") != mine:
            raise ValueError(f"state_dict was saved with a grouped order of {state.get('groups')}, this loader's "
                             f"is {mine} (the same source and window are needed to resume)")
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
        self.seed, self.epoch, self.start, self.position = state["seed"], state["epoch"], start, position
