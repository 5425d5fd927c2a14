"""A file list in shared memory, for worker processes.

A FileSource pickled to each of 16 workers copies every path into every
process: for ImageNet's 1.28 M files about 100 MB each, 1.6 GB in all. The
worker pool instead writes the paths and labels once into a shared block and
sends workers its name; they read it in place.

Layout: offsets (n + 1) int64 | labels (n) int64 | UTF-8 path bytes.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np

from .base import FileSource, read_file


class SharedFileSource:
    """The same samples as a FileSource, backed by one shared-memory block (create it in the owner)."""

    def __init__(self, name: str, n: int) -> None:
        self._name, self._n = name, n
        self._attach()

    @classmethod
    def create(cls, source: FileSource) -> tuple["SharedFileSource", shared_memory.SharedMemory]:
        """Copy ``source`` into a new block; returns the source and the block, which the caller unlinks."""
        encoded = [p.encode("utf-8", "surrogateescape") for p in source.paths]
        n = len(encoded)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        head = (2 * n + 1) * 8
        shm = shared_memory.SharedMemory(create=True, size=max(1, head + int(offsets[-1])))
        np.ndarray(n + 1, np.int64, shm.buf, 0)[:] = offsets
        np.ndarray(n, np.int64, shm.buf, (n + 1) * 8)[:] = np.asarray(source.labels, np.int64)
        shm.buf[head : head + int(offsets[-1])] = b"".join(encoded)
        return cls(shm.name, n), shm

    def _attach(self) -> None:
        self._shm = shared_memory.SharedMemory(name=self._name)
        n = self._n
        self._offsets = np.ndarray(n + 1, np.int64, self._shm.buf, 0)
        self._labels = np.ndarray(n, np.int64, self._shm.buf, (n + 1) * 8)
        self._head = (2 * n + 1) * 8

    def __getstate__(self) -> dict:
        return {"name": self._name, "n": self._n}

    def __setstate__(self, state: dict) -> None:
        self._name, self._n = state["name"], state["n"]
        self._attach()

    def __len__(self) -> int:
        return self._n

    def path(self, index: int) -> str:
        a, b = int(self._offsets[index]), int(self._offsets[index + 1])
        return bytes(self._shm.buf[self._head + a : self._head + b]).decode("utf-8", "surrogateescape")

    def label(self, index: int) -> int:
        return int(self._labels[index])

    def read(self, index: int, max_bytes: int | None = None) -> bytes:
        return read_file(self.path(index), max_bytes)
