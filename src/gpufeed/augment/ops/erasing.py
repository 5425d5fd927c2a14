"""RandomErasing on the normalised batch, each sample's box drawn as torchvision draws it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from ..params import SampleRandom
from .pixels import on

Box = tuple[int, int, int, int]  # (top, left, height, width)


@dataclass(frozen=True)
class Erasing:
    """RandomErasing's settings: probability ``p``, area ``scale``, aspect ``ratio``, fill ``value`` (one
    per channel, in the normalised batch's units, as torchvision erases after Normalize)."""

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: tuple[float, ...] = (0.0,)
    salt: ClassVar[int] = 0x7A1B_0002

    def draw(self, rnd: SampleRandom, size: int) -> Box | None:
        """The box to erase in an S x S image, or None: torchvision's draw (probability p, then up to 10 tries
        of area and log-uniform aspect, the position uniform over where it fits)."""
        if rnd.uniform() >= self.p:
            return None
        area = size * size
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            erase_area = area * rnd.uniform(self.scale[0], self.scale[1])
            aspect = math.exp(rnd.uniform(lo, hi))
            h = int(round(math.sqrt(erase_area * aspect)))
            w = int(round(math.sqrt(erase_area / aspect)))
            if h < size and w < size:
                return rnd.randint(0, size - h), rnd.randint(0, size - w), h, w
        return None

    def apply(self, images: torch.Tensor, choices: Sequence[Box | None]) -> torch.Tensor:
        """(B, C, S, S) float -> a new batch with sample i's box ``choices[i]`` filled with ``value``: one
        masked pass (an empty box where a sample drew none)."""
        size = images.shape[-1]
        if not any(choices):  # no sample of the batch drew a box
            return images.clone()
        b = on(images.device, [box or (0, 0, 0, 0) for box in choices], torch.int64).view(-1, 4, 1, 1)
        at = torch.arange(size, device=images.device)
        rows = (at.view(1, size, 1) >= b[:, 0]) & (at.view(1, size, 1) < b[:, 0] + b[:, 2])
        cols = (at.view(1, 1, size) >= b[:, 1]) & (at.view(1, 1, size) < b[:, 1] + b[:, 3])
        # one fill value for every channel goes as a number (no upload); one per channel as a tensor
        value = self.value[0] if len(self.value) == 1 else on(images.device, self.value, images.dtype).view(1, -1, 1, 1)
        return torch.where((rows & cols).unsqueeze(1), value, images)
