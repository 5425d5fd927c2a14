"""torchvision's random containers on uint8 batches, their inner ops all device ops: ``RandomApply``,
``RandomChoice`` and ``RandomOrder``. A sample's choice is the container's own draw, then its inner ops'
draws from the same stream, so a container's samples draw apart from every other op's, and two containers
of one recipe apart from each other (``salt``: one per place in the recipe)."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

import torch

from ..params import AHEAD, SampleRandom
from .pixels import each_group

_SALT = 0x7A1B_0C00  # the first container's; the next ones' follow it


def container_salt(place: int) -> int:
    """The stream of the container at ``place`` (0, 1, ...) among a recipe's containers."""
    return _SALT + place


def each_op(ops: Sequence[Any]) -> Iterator[Any]:
    """``ops`` and, for each container among them, its inner ops, nested ones too."""
    for op in ops:
        yield op
        yield from each_op(getattr(op, "ops", ()))


def uniforms(op: Any) -> int:
    """How many uniforms ``op``'s draw usually takes: what it declares, else ``SampleRandom.streams``' default."""
    declared = getattr(op, "uniforms", None)
    return AHEAD if declared is None else declared


class _Inner:
    """What the containers share: ``ops`` (pixel ops; ``SampleOps.check_size`` checks them for the image size)."""

    ops: tuple[Any, ...]

    def _run(self, images: torch.Tensor, at: int, draws: Sequence[Any]) -> torch.Tensor:
        return self.ops[at].apply(images, draws)


@dataclass(frozen=True)
class Apply(_Inner):
    """``RandomApply(ops, p)``: all of ``ops``, in order, with probability ``p``."""

    ops: tuple[Any, ...]
    p: float
    salt: int = _SALT

    def __post_init__(self) -> None:
        if not self.ops or not 0 <= self.p <= 1:
            raise ValueError(f"RandomApply needs at least one op and p in [0, 1], got {len(self.ops)} ops, "
                             f"p={self.p!r}")

    @property
    def uniforms(self) -> int:
        """The p draw, then each op's."""
        return 1 + sum(uniforms(op) for op in self.ops)

    def draw(self, rnd: SampleRandom, size: int) -> tuple[Any, ...] | None:
        """None where the sample skips the ops (torchvision's ``torch.rand(1) >= p``), else each op's draw."""
        if rnd.uniform() >= self.p:
            return None
        return tuple(op.draw(rnd, size) for op in self.ops)

    def apply(self, images: torch.Tensor, choices: Sequence[tuple[Any, ...] | None]) -> torch.Tensor:
        def chain(x: torch.Tensor, _: object, members: list[int]) -> torch.Tensor:
            for at in range(len(self.ops)):
                x = self._run(x, at, [choices[i][at] for i in members])
            return x

        return each_group(images, [c is not None for c in choices], chain, skip=False)


class Picked(NamedTuple):
    """One sample's RandomChoice: which op, and its draw."""

    at: int
    draw: Any


@dataclass(frozen=True)
class Choice(_Inner):
    """``RandomChoice(ops, p)``: one of ``ops``, op i with probability ``p[i]`` (normalised, as torchvision
    normalises them)."""

    ops: tuple[Any, ...]
    p: tuple[float, ...]
    salt: int = _SALT
    # the normalised weights' running sums, where each op's share of [0, 1) ends
    edges: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.ops or len(self.p) != len(self.ops) or any(not v >= 0 for v in self.p) or not sum(self.p) > 0:
            raise ValueError(f"RandomChoice needs one weight >= 0 per op, not all 0, got p={list(self.p)} for "
                             f"{len(self.ops)} ops")
        total = sum(self.p)
        object.__setattr__(self, "edges", tuple(itertools.accumulate(v / total for v in self.p)))

    @property
    def uniforms(self) -> int:
        """The pick, then the picked op's draw (the longest of them)."""
        return 1 + max(uniforms(op) for op in self.ops)

    def draw(self, rnd: SampleRandom, size: int) -> Picked:
        at = min(bisect.bisect_right(self.edges, rnd.uniform()), len(self.ops) - 1)
        while self.p[at] == 0:  # a float sum that rounds below 1 never lands on a weight of 0
            at -= 1
        return Picked(at, self.ops[at].draw(rnd, size))

    def apply(self, images: torch.Tensor, choices: Sequence[Picked]) -> torch.Tensor:
        return each_group(images, [c.at for c in choices],
                          lambda x, at, members: self._run(x, at, [choices[i].draw for i in members]))


class Ordered(NamedTuple):
    """One sample's RandomOrder: the order of the ops and each op's draw (by the op's place in ``ops``)."""

    order: tuple[int, ...]
    draws: tuple[Any, ...]


@dataclass(frozen=True)
class Order(_Inner):
    """``RandomOrder(ops)``: all of ``ops``, in an order drawn per sample, every order equally likely."""

    ops: tuple[Any, ...]
    salt: int = _SALT

    def __post_init__(self) -> None:
        if not self.ops:
            raise ValueError("RandomOrder needs at least one op")

    @property
    def uniforms(self) -> int:
        """One per swap of the shuffle, then each op's draw."""
        return len(self.ops) - 1 + sum(uniforms(op) for op in self.ops)

    def draw(self, rnd: SampleRandom, size: int) -> Ordered:
        order = list(range(len(self.ops)))  # torch.randperm: every order equally likely (Fisher-Yates)
        for i in range(len(order) - 1, 0, -1):
            j = rnd.randint(0, i)
            order[i], order[j] = order[j], order[i]
        return Ordered(tuple(order), tuple(op.draw(rnd, size) for op in self.ops))

    def apply(self, images: torch.Tensor, choices: Sequence[Ordered]) -> torch.Tensor:
        """For each place in the order, one pass per op over the samples that put it there."""
        for k in range(len(self.ops)):
            images = each_group(images, [c.order[k] for c in choices],
                                lambda x, at, members: self._run(x, at, [choices[i].draws[at] for i in members]))
        return images
