"""What a CPU device's workers apply to each image they finish (no torch here: workers never import it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkerNormalize:
    """What a CPU device's workers apply to each image they finish: (S, S, 3) uint8 ->
    ``x * scale + shift`` float32, (S, S, 3) for channels_last, else (3, S, S). Picklable; the same arithmetic
    as ``Normalize._on_cpu``."""

    scale: tuple[float, float, float]
    shift: tuple[float, float, float]
    channels_last: bool

    @property
    def layout(self) -> str:
        return "nhwc" if self.channels_last else "nchw"

    def into(self, image: np.ndarray, out: np.ndarray) -> None:
        scale, shift = np.array(self.scale, np.float32), np.array(self.shift, np.float32)
        if self.channels_last:
            np.multiply(image, scale, out=out)
            out += shift
        else:
            np.multiply(image.transpose(2, 0, 1), scale.reshape(3, 1, 1), out=out)
            out += shift.reshape(3, 1, 1)
