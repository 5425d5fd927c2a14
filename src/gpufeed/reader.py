"""Host side of the GPU path: read encoded bytes, parse headers, draw crop boxes.

No pixel is decoded here except for images no GPU decoder takes (not JPEG, or
JPEG in CMYK/YCCK): those are decoded on the CPU in the same threads, so an odd
image never fails a GPU batch. File reading and libjpeg/Pillow release the
GIL, so a thread pool is enough.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from .augment.params import AugmentSpec, CropBox
from .decode.base import DecodeError
from .decode.cpu import CpuDecoder
from .sources.base import Source


@dataclass
class EncodedBatch:
    """One batch before decode. ``data[i]`` is bytes for the GPU, or None when ``pixels[i]``
    already holds the CPU-decoded (h, w, 3) uint8 image. ``labels``: (B,) int64."""

    data: list
    pixels: list
    sizes: list  # (width, height) from the header
    boxes: list
    paths: list
    labels: torch.Tensor


class EncodedBatchReader:
    """Turns lists of sample indices into ``EncodedBatch``es with ``threads`` reader threads."""

    def __init__(self, source: Source, augment: AugmentSpec, *, max_pixels: int, threads: int) -> None:
        self.source, self.augment = source, augment
        self.decoder = CpuDecoder(max_pixels=max_pixels)
        self._threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpufeed-read")

    def _one(self, index: int, seed: int, epoch: int):
        path = self.source.path(index)
        try:
            data = self.source.read(index)
        except OSError as e:
            raise DecodeError(path, f"cannot read the file ({type(e).__name__}: {e.strerror or e})") from None
        width, height, fast = self.decoder.header(data, path)
        box = self.augment.draw(width, height, seed=seed, epoch=epoch, index=index)
        pixels = None if fast else self.decoder.decode(data, path, fast=False)
        return (data if fast else None), pixels, (width, height), box, path, self.source.label(index)

    def _chunk(self, indices: list[int], seed: int, epoch: int) -> list[tuple]:
        return [self._one(k, seed, epoch) for k in indices]

    def batches(self, batches: list[list[int]], seed: int, epoch: int, ahead: int = 2) -> Iterator[EncodedBatch]:
        """Yield one EncodedBatch per index list, reading up to ``ahead`` batches in advance."""
        pending = []
        step = max(8, -(-max(map(len, batches), default=1) // self._threads))  # a few tasks per batch, not one per image
        for i in range(len(batches)):
            while len(pending) <= ahead and len(pending) + i < len(batches):
                b = batches[i + len(pending)]
                pending.append([self._pool.submit(self._chunk, b[k : k + step], seed, epoch)
                                for k in range(0, len(b), step)])
            rows = [row for f in pending.pop(0) for row in f.result()]
            data, pixels, sizes, boxes, paths, labels = (list(col) for col in zip(*rows))
            yield EncodedBatch(data, pixels, sizes, boxes, paths, torch.tensor(labels, dtype=torch.int64))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
