"""What a CPU device's workers apply to each image they finish (no torch here: workers never import it)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkerNormalize:
    """``x * scale + shift`` for one (S, S, 3) uint8 image into float32, (S, S, 3) for channels_last, else
    (3, S, S): each image in one multiply-and-cast pass and one add. A CPU device's workers apply it to each
    image they finish, the main process (``Normalize``) to each image of a batch. Picklable."""

    scale: tuple[float, float, float]
    shift: tuple[float, float, float]
    channels_last: bool

    @property
    def layout(self) -> str:
        return "nhwc" if self.channels_last else "nchw"

    @functools.cached_property
    def _per_channel(self) -> tuple[np.ndarray, np.ndarray]:
        return np.array(self.scale, np.float32), np.array(self.shift, np.float32)

    @functools.lru_cache(maxsize=4)
    def _along_rows(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """scale and shift tiled along a row of ``width`` pixels x 3 channels (NHWC: a long inner loop)."""
        scale, shift = self._per_channel
        return np.tile(scale, width), np.tile(shift, width)

    def into(self, image: np.ndarray, out: np.ndarray) -> None:
        if self.channels_last:
            h, w, _ = image.shape
            scale, shift = self._along_rows(w)
            dst = out.reshape(h, w * 3)
            np.multiply(image.reshape(h, w * 3), scale, out=dst)
            dst += shift
        else:  # read through the image's transposed view
            scale, shift = self._per_channel
            np.multiply(image.transpose(2, 0, 1), scale.reshape(3, 1, 1), out=out)
            out += shift.reshape(3, 1, 1)
