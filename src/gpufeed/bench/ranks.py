"""The bench under torchrun: this process's rank, values reduced over the ranks, and ranks kept in step."""

from __future__ import annotations

import torch

from ..sampling import process_group


def ranks() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else (0, 1)."""
    return process_group() or (0, 1)


def over_ranks(value: float, device: torch.device, op: str = "SUM") -> float:
    """``value`` reduced over the ranks with ``op`` ("SUM", "MAX"); itself without a process group."""
    if ranks()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
    return float(t.item())


def together() -> None:
    """All ranks reach this point before any goes on (epochs start together)."""
    if ranks()[1] > 1:
        torch.distributed.barrier()
