"""Epoch order, rank shards and resumable position.

The order of epoch ``e`` is ``torch.randperm(n, generator=seed + e)``, then
padded or truncated to a multiple of ``world_size`` and strided by rank,
exactly as ``torch.utils.data.DistributedSampler`` does, so a run that swaps
its DataLoader for gpufeed sees the same samples on the same ranks.

    full order  [7 2 9 4 0 5 1 8 3 6]      (seed, epoch)
    rank 0 of 2  7 . 9 . 0 . 1 . 3 .  ->  [7 9 0 1 3]
    rank 1 of 2  . 2 . 4 . 5 . 8 . 6  ->  [2 4 5 8 6]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ShardedSampler", "resolve_rank"]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Fill ``rank``/``world_size`` from ``torch.distributed`` when initialised, else (0, 1)."""
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


@dataclass
class ShardedSampler:
    """Sample indices for one rank, one epoch at a time, resumable mid-epoch.

    ``drop_last`` as in ``DistributedSampler``: True drops the tail so every
    rank gets ``n // world_size`` samples; False pads with the first samples of
    the order so every rank gets ``ceil(n / world_size)``.
    """

    num_samples_total: int
    shuffle: bool = True
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    epoch: int = 0
    position: int = 0  # samples of this epoch already handed out on this rank

    def __post_init__(self) -> None:
        if self.num_samples_total < 1:
            raise ValueError(f"the dataset has no samples (num_samples_total={self.num_samples_total})")
        if self.drop_last and self.num_samples_total < self.world_size:
            raise ValueError(
                f"drop_last=True leaves no sample per rank: {self.num_samples_total} samples, "
                f"world_size={self.world_size}"
            )

    def __len__(self) -> int:
        """Samples per epoch on this rank."""
        if self.drop_last:
            return self.num_samples_total // self.world_size
        return math.ceil(self.num_samples_total / self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (a resumed position is kept if it is the same epoch)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def epoch_indices(self, epoch: int | None = None) -> list[int]:
        """All of this rank's indices for ``epoch`` (default: the current one), in order."""
        n = self.num_samples_total
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + (self.epoch if epoch is None else epoch))
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        total = len(self) * self.world_size
        if total > n:
            pad = total - n
            order += (order * math.ceil(pad / n))[:pad]
        else:
            order = order[:total]
        return order[self.rank : total : self.world_size]

    def remaining(self) -> list[int]:
        """The indices of this epoch not yet handed out, in order."""
        return self.epoch_indices()[self.position :]

    def advance(self, count: int) -> None:
        """Record that ``count`` more samples reached the consumer."""
        self.position += count

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "world_size": self.world_size,
            "num_samples_total": self.num_samples_total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``; the dataset size and world size must match."""
        for key in ("num_samples_total", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state_dict has {key}={state[key]}, this loader has {getattr(self, key)}")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"state_dict position must be in [0, {len(self)}], got {state['position']}")
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
