"""The shared-memory batch ring: one block of slots, each holding a whole batch.

Per slot and sample: the augmented pixels (S, S, 3) uint8 and the label; on
the GPU path also a metadata row and room for the encoded bytes. Worker
processes write into it; the main process reads views of finished slots, so
no pixel or byte is pickled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

META_FIELDS = ("kind", "length", "width", "height", "x", "y", "box_w", "box_h", "flip")
KIND_PIXELS, KIND_BYTES = 0, 1


class Ring:
    """Views of the shared block, per slot and sample.

    images (slots, B, S, S, 3) uint8 and labels (slots, B) int64 always; for the
    GPU path also meta (slots, B, 9) int64 (``META_FIELDS``) and arena
    (slots, B, capacity) uint8 holding each sample's encoded bytes.
    """

    def __init__(self, shm: shared_memory.SharedMemory, num_slots: int, batch_size: int, size: int,
                 capacity: int = 0) -> None:
        self.shm = shm
        views, offset = {}, 0
        for name, shape, dtype in self.layout(num_slots, batch_size, size, capacity):
            views[name] = np.ndarray(shape, dtype, shm.buf, offset)
            offset = _align(offset + int(np.prod(shape)) * np.dtype(dtype).itemsize)
        self.images, self.labels = views["images"], views["labels"]
        self.meta, self.arena = views.get("meta"), views.get("arena")

    @staticmethod
    def layout(num_slots: int, batch_size: int, size: int, capacity: int) -> list:
        parts = [("images", (num_slots, batch_size, size, size, 3), np.uint8),
                 ("labels", (num_slots, batch_size), np.int64)]
        if capacity:
            parts += [("meta", (num_slots, batch_size, len(META_FIELDS)), np.int64),
                      ("arena", (num_slots, batch_size, capacity), np.uint8)]
        return parts

    @classmethod
    def nbytes(cls, num_slots: int, batch_size: int, size: int, capacity: int = 0) -> int:
        return sum(_align(int(np.prod(shape)) * np.dtype(dt).itemsize)
                   for _, shape, dt in cls.layout(num_slots, batch_size, size, capacity))


def _align(n: int, to: int = 4096) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class SlotView:
    """numpy views of one finished batch in the ring: images (n, S, S, 3) uint8, labels (n,) int64,
    and on the GPU path meta (n, 9) int64 and arena (n, capacity) uint8. Valid until the slot is reused."""

    images: np.ndarray
    labels: np.ndarray
    meta: np.ndarray | None
    arena: np.ndarray | None


def check_shm_space(needed: int, root: str = "/dev/shm") -> None:
    """Fail with advice, not with a SIGBUS in a worker later, when /dev/shm is too small (Docker's
    default is 64 MB). ``needed``: the bytes the ring will actually touch."""
    try:
        st = os.statvfs(root)
    except OSError:
        return  # no /dev/shm (not Linux): SharedMemory uses what the platform has
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise RuntimeError(
            f"{root} has {free / 2**20:.0f} MB free, the batch ring needs about {needed / 2**20:.0f} MB "
            "(batch_size x image_size^2 x 3 bytes x slots). Enlarge it (Docker: --shm-size=2g) or lower batch_size."
        )
