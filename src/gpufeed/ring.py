"""The shared-memory batch ring: one block of slots, each holding a whole batch.

Per slot and sample: the augmented pixels (S, S, 3) uint8 and the label; on
the GPU path also a metadata row and room for the encoded bytes, and the
pixels' place is larger (``PIXEL_ROOM``): it also holds the rows of a crop
the CPU decoded for the GPU to resize (``KIND_ROWS``). Worker processes
write into it; the main process reads views of finished slots, so no pixel
or byte is pickled.
"""

from __future__ import annotations

import copy
import ctypes
import os
import sys
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from .records import BOX, KIND_BYTES, KIND_PIXELS, KIND_ROWS, Meta  # noqa: F401 (the ring's layout)


# Bytes of each arena position every process maps when it starts (``Ring.map_pages``): files up to this size
# are written and read without page faults; larger ones fault in the rest (BENCHMARKS.md#worker-processes).
MAP_ARENA_BYTES = 256 << 10
# GPU path: each position's pixel room holds this many S x S x 3 images' worth of bytes (the rows of a
# crop the CPU decoded; larger crops are resized by the worker itself).
PIXEL_ROOM = 3


class Ring:
    """Views of the shared block, per slot and sample.

    images (slots, B, S, S, 3) uint8 and labels (slots, B) int64 always; for a CPU
    device also output (slots, B, S, S, 3) (``output="nhwc"``) or (slots, B, 3, S, S)
    (``"nchw"``) float32, the normalised images the workers write; for the GPU path also meta (slots, B, 9) int64 (columns ``Meta``), arena
    (slots, B, capacity) uint8 holding each sample's encoded bytes, and rooms
    (slots, B, PIXEL_ROOM x S x S x 3) uint8, each position's pixel room, whose
    first S x S x 3 bytes are its ``images`` entry (None on the CPU path, where
    ``images`` is contiguous). ``at(s)``: these views for images of a smaller size s.
    """

    def __init__(self, shm: shared_memory.SharedMemory, num_slots: int, batch_size: int, size: int,
                 capacity: int = 0, output: str | None = None) -> None:
        self.shm, self.size = shm, size
        views, offset = {}, 0
        for name, shape, dtype in self.layout(num_slots, batch_size, size, capacity, output):
            views[name] = np.ndarray(shape, dtype, shm.buf, offset)
            offset = _align(offset + int(np.prod(shape)) * np.dtype(dtype).itemsize)
        self.rooms = views.get("rooms")
        self.images = views["images"] if self.rooms is None else _packed(self.rooms, (batch_size, size, size, 3), True)
        self.labels = views["labels"]
        self.meta, self.arena, self.output = views.get("meta"), views.get("arena"), views.get("output")
        # the views at each size (``at``), and the ring at the size it was made for, shared with them
        self._layout, self._sizes, self._full = output, {size: self}, self

    def at(self, size: int) -> "Ring":
        """The same block seen at a smaller image size (progressive resizing; no new memory): each slot's
        (B, size, size, 3) images and float32 output packed at the start of the slot's room for them, so a
        batch is laid out as a ring made for ``size`` lays it out; on the GPU path each position's images
        at the start of its pixel room and the room cut to what a ring made for ``size`` gives it (so the
        workers make the same choices). Labels, meta and arena are the same views."""
        if size not in self._sizes:
            full = self._full
            if not 1 <= size <= full.size:
                raise ValueError(f"image size {size} is over the {full.size} this ring was made for")
            ring = copy.copy(full)
            ring.size, b = size, full.labels.shape[1]
            if full.rooms is not None:
                ring.rooms = full.rooms[:, :, : PIXEL_ROOM * size * size * 3]
                ring.images = _packed(full.rooms, (b, size, size, 3), True)
            else:
                ring.images = _packed(full.images, (b, size, size, 3))
            if full.output is not None:
                ring.output = _packed(full.output, (b, size, size, 3) if full._layout == "nhwc" else (b, 3, size, size))
            self._sizes[size] = ring
        return self._sizes[size]

    @staticmethod
    def layout(num_slots: int, batch_size: int, size: int, capacity: int, output: str | None = None) -> list:
        if not capacity:
            out = {None: [], "nhwc": [("output", (num_slots, batch_size, size, size, 3), np.float32)],
                   "nchw": [("output", (num_slots, batch_size, 3, size, size), np.float32)]}[output]
            return [("images", (num_slots, batch_size, size, size, 3), np.uint8),
                    ("labels", (num_slots, batch_size), np.int64)] + out
        return [("rooms", (num_slots, batch_size, PIXEL_ROOM * size * size * 3), np.uint8),
                ("labels", (num_slots, batch_size), np.int64),
                ("meta", (num_slots, batch_size, len(Meta)), np.int64),
                ("arena", (num_slots, batch_size, capacity), np.uint8)]

    @property
    def pixels(self) -> np.ndarray:
        """The whole pixel area, contiguous: ``rooms`` on the GPU path, ``images`` on the CPU path."""
        return self.images if self.rooms is None else self.rooms

    def slot(self, slot: int) -> "SlotView":
        """Views of one whole slot."""
        pick = lambda a: None if a is None else a[slot]
        return SlotView(self.images[slot], self.labels[slot], pick(self.meta), pick(self.arena), pick(self.rooms),
                        pick(self.output))

    def map_pages(self, arena_bytes: int = MAP_ARENA_BYTES) -> bool:
        """Map the ring into this process's page tables now: all of ``images`` and ``labels``, and the
        first ``arena_bytes`` of each sample's room in ``arena`` (and ``meta``). Otherwise each worker
        takes a page fault per 4 KB page the first time it writes a position, and which worker writes
        which position changes every batch, so every process faults in nearly the whole ring over the
        first epochs (3-16% of the workers' CPU: BENCHMARKS.md#worker-processes). Uses
        ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), one call per arena position; elsewhere reads a
        byte of each page (never writes: other processes may be filling the ring). The pages made
        resident are the ring's own, counted once. Returns whether madvise did it."""
        parts = [self.pixels, self.labels] + [a for a in (self.meta, self.output) if a is not None]
        ranges = [(a.ctypes.data, a.nbytes) for a in parts]
        n = min(arena_bytes, self.arena.shape[-1]) if self.arena is not None else 0
        if n > 0:
            step = self.arena.strides[1]
            ranges += [(self.arena.ctypes.data + i * step, n) for i in range(self.arena.shape[0] * self.arena.shape[1])]
        if all(_populate_write(addr, length) for addr, length in ranges):
            return True
        for a in parts:  # one byte read per page: the kernel maps it (shared memory: writable)
            a.reshape(-1).view(np.uint8)[::_PAGE].max()
        if n > 0:
            self.arena[:, :, :n:_PAGE].max()
        return False

    @classmethod
    def nbytes(cls, num_slots: int, batch_size: int, size: int, capacity: int = 0, output: str | None = None) -> int:
        return sum(_align(int(np.prod(shape)) * np.dtype(dt).itemsize)
                   for _, shape, dt in cls.layout(num_slots, batch_size, size, capacity, output))


def _packed(a: np.ndarray, shape: tuple[int, ...], per_position: bool = False) -> np.ndarray:
    """A (slots, *shape) C-ordered view of the first elements of each slot of ``a`` (contiguous within a slot);
    ``per_position``: each of the shape[0] positions' elements at the start of its own row of ``a``
    (``a`` (slots, positions, room))."""
    item = a.itemsize
    inner = [item]
    for n in reversed(shape[1:]):
        inner.insert(0, inner[0] * n)
    step = a.strides[1] if per_position else inner[0]
    return np.ndarray((a.shape[0],) + shape, a.dtype, a, strides=(a.strides[0], step, *inner[1:]))


def _align(n: int, to: int = 4096) -> int:
    return (n + to - 1) // to * to


_PAGE = 4096
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None  # the process's symbols, libc's included


def _populate_write(addr: int, length: int) -> bool:
    """``madvise(MADV_POPULATE_WRITE)`` over [addr, addr + length) widened to pages; False where it is
    not available (not Linux, a kernel before 5.14) or fails."""
    if _libc is None:
        return False
    start = addr // _PAGE * _PAGE
    size = _align(addr + length) - start
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), _MADV_POPULATE_WRITE) == 0


@dataclass(frozen=True)
class SlotView:
    """numpy views of one finished batch in the ring: images (n, S, S, 3) uint8, labels (n,) int64,
    on the GPU path meta (n, 9) int64, arena (n, capacity) uint8 and rooms (n, room) uint8, for a CPU
    device output (n, ...) float32 (``Ring``). Valid until the slot is reused."""

    images: np.ndarray
    labels: np.ndarray
    meta: np.ndarray | None = None
    arena: np.ndarray | None = None
    rooms: np.ndarray | None = None
    output: np.ndarray | None = None

    @property
    def size(self) -> int:
        """The images' side, S."""
        return self.images.shape[1]

    @property
    def pixels(self) -> np.ndarray:
        """The pixel area of these samples, whole (``Ring.pixels``): rooms if there are, else images."""
        return self.images if self.rooms is None else self.rooms

    def head(self, n: int) -> "SlotView":
        """The first ``n`` samples."""
        cut = lambda a: None if a is None else a[:n]
        return SlotView(self.images[:n], self.labels[:n], cut(self.meta), cut(self.arena), cut(self.rooms),
                        cut(self.output))


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
