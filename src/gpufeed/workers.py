"""CPU worker processes and the shared-memory batch ring.

    main process                         worker processes (no torch imported)
    ------------                         ------------------------------------
    submit(batch) -> chunks --tasks-->   read bytes, decode, crop, resize, flip
                                         write uint8 pixels + labels into the slot
                                         (GPU path: write the JPEG bytes + crop box
                                         instead; odd images still finished here)
    collect(batch) <--------done------   report (batch, chunk, error)

The ring is one shared-memory block of ``num_slots`` slots, each holding a
whole batch as (B, S, S, 3) uint8 plus (B,) int64 labels, so no pixel is
pickled. A batch is split into chunks that any idle worker takes from one
queue. A slot belongs to the main process from ``collect`` until ``release``;
the caller must not read a slot's views after releasing it.

Workers start through ``forkserver`` on Linux (safe with CUDA initialised in
the parent, and usable from Jupyter), ``spawn`` elsewhere. They are stopped
by ``close``, by garbage collection of the pool, or at interpreter exit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from .augment.cpu import crop_resize_into, reduction_for
from .augment.params import AugmentSpec
from .decode.base import DecodeError
from .decode.cpu import CpuDecoder
from .sources.base import Source

__all__ = ["PipelineSpec", "SlotView", "WorkerError", "WorkerPool", "encode_sample_into", "load_sample_into"]

_POLL_S = 0.5


class WorkerError(RuntimeError):
    """A worker process died or failed; the message names the worker and the file."""


@dataclass(frozen=True)
class PipelineSpec:
    """Everything a worker needs to turn a sample index into pixels (picklable)."""

    source: Source
    augment: AugmentSpec
    max_pixels: int
    gpu_bytes_capacity: int = 0  # > 0: leave JPEGs encoded for GPU decode, up to this many bytes each


def load_sample_into(
    spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, index: int, out: np.ndarray
) -> int:
    """Read, decode and augment sample ``index`` into ``out`` ((S, S, 3) uint8); return its label."""
    path = spec.source.path(index)
    try:
        data = spec.source.read(index)
    except OSError as e:
        raise DecodeError(path, f"cannot read the file ({type(e).__name__}: {e.strerror or e})") from None
    width, height, fast = decoder.header(data, path)
    box = spec.augment.draw(width, height, seed=seed, epoch=epoch, index=index)
    reduce = reduction_for(box, out.shape[0]) if fast else 1
    image = decoder.decode(data, path, fast=fast, reduce=reduce)
    crop_resize_into(image, box, (width, height), out)
    return spec.source.label(index)


META_FIELDS = ("kind", "length", "width", "height", "x", "y", "box_w", "box_h", "flip")
KIND_PIXELS, KIND_BYTES = 0, 1


def encode_sample_into(
    spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, index: int, ring: "_Ring", slot: int, k: int
) -> int:
    """GPU path: put sample ``index``'s JPEG bytes and crop box in the slot for GPU decode; what no GPU
    decoder takes (not JPEG, CMYK, larger than the capacity) is finished here on the CPU instead."""
    path = spec.source.path(index)
    try:
        data = spec.source.read(index)
    except OSError as e:
        raise DecodeError(path, f"cannot read the file ({type(e).__name__}: {e.strerror or e})") from None
    width, height, fast = decoder.header(data, path)
    box = spec.augment.draw(width, height, seed=seed, epoch=epoch, index=index)
    meta = ring.meta[slot, k]
    if fast and len(data) <= spec.gpu_bytes_capacity:
        ring.arena[slot, k, : len(data)] = np.frombuffer(data, np.uint8)
        meta[:] = (KIND_BYTES, len(data), width, height, box.x, box.y, box.width, box.height, int(box.flip))
    else:
        reduce = reduction_for(box, ring.images.shape[2]) if fast else 1
        crop_resize_into(decoder.decode(data, path, fast=fast, reduce=reduce), box, (width, height),
                         ring.images[slot, k])
        meta[:] = (KIND_PIXELS, 0, width, height, box.x, box.y, box.width, box.height, int(box.flip))
    return spec.source.label(index)


class _Ring:
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


def _worker_main(
    worker_id: int,
    spec: PipelineSpec,
    shm_name: str,
    ring_shape: tuple[int, int, int],
    tasks: Any,
    results: Any,
    current: Any,
    generation: Any,
) -> None:
    shm = shared_memory.SharedMemory(name=shm_name)
    ring = _Ring(shm, *ring_shape, spec.gpu_bytes_capacity)
    decoder = CpuDecoder(max_pixels=spec.max_pixels)
    try:
        while True:
            task = tasks.get()
            if task is None:
                return
            gen, batch_id, chunk_id, slot, seed, epoch, start, indices = task
            error = None
            if gen == generation.value:  # stale chunks of an abandoned epoch are acknowledged, not decoded
                for k, index in enumerate(indices, start):
                    current[worker_id] = index
                    try:
                        if spec.gpu_bytes_capacity:
                            ring.labels[slot, k] = encode_sample_into(spec, decoder, seed, epoch, index, ring, slot, k)
                        else:
                            ring.labels[slot, k] = load_sample_into(spec, decoder, seed, epoch, index,
                                                                    ring.images[slot, k])
                    except Exception as e:  # reported to the main process, which raises it
                        error = (spec.source.path(index), f"{type(e).__name__}: {e}", traceback.format_exc())
                        break
                current[worker_id] = -1
            results.put((gen, batch_id, chunk_id, error))
    except KeyboardInterrupt:
        return
    finally:
        del ring
        shm.close()


def _default_context() -> mp.context.BaseContext:
    methods = mp.get_all_start_methods()
    return mp.get_context("forkserver" if "forkserver" in methods else "spawn")


@dataclass(frozen=True)
class SlotView:
    """numpy views of one finished batch in the ring: images (n, S, S, 3) uint8, labels (n,) int64,
    and on the GPU path meta (n, 9) int64 and arena (n, capacity) uint8. Valid until the slot is reused."""

    images: np.ndarray
    labels: np.ndarray
    meta: np.ndarray | None
    arena: np.ndarray | None


class WorkerPool:
    """``num_workers`` processes filling a ring of ``num_slots`` batch slots.

    ``submit(batch_id, slot, seed, epoch, indices)`` queues a batch; ``collect``
    blocks until batch ``batch_id`` is complete and returns (images, labels)
    as a ``SlotView`` of its slot.
    """

    def __init__(self, spec: PipelineSpec, *, num_workers: int, num_slots: int, batch_size: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        size = spec.augment.image_size
        self.num_slots, self.batch_size, self.size = num_slots, batch_size, size
        self._chunk = max(1, -(-batch_size // (2 * num_workers)))  # ~2 chunks per worker per batch
        ctx = _default_context()
        capacity = spec.gpu_bytes_capacity
        self._shm = shared_memory.SharedMemory(create=True, size=_Ring.nbytes(num_slots, batch_size, size, capacity))
        self._ring = _Ring(self._shm, num_slots, batch_size, size, capacity)
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._current = ctx.Array("q", [-1] * num_workers, lock=False)
        self._generation = ctx.Value("q", 0, lock=False)
        self._spec = spec
        self._pending: dict[int, dict[str, Any]] = {}
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(i, spec, self._shm.name, (num_slots, batch_size, size), self._tasks, self._results,
                      self._current, self._generation),
                daemon=True,
                name=f"gpufeed-worker-{i}",
            )
            for i in range(num_workers)
        ]
        for p in self._procs:
            p.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._tasks, self._shm)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def submit(self, batch_id: int, slot: int, seed: int, epoch: int, indices: list[int]) -> None:
        chunks = [indices[i : i + self._chunk] for i in range(0, len(indices), self._chunk)]
        gen = self._generation.value
        self._pending[batch_id] = {"left": len(chunks), "n": len(indices), "slot": slot, "error": None,
                                   "indices": indices}
        for c, chunk in enumerate(chunks):
            self._tasks.put((gen, batch_id, c, slot, seed, epoch, c * self._chunk, chunk))

    def collect(self, batch_id: int) -> "SlotView":
        entry = self._pending[batch_id]
        self._check_alive()  # a dead worker is reported even if others finish its share
        while entry["left"]:
            self._receive_one()
        del self._pending[batch_id]
        if entry["error"] is not None:
            path, reason, tb = entry["error"]
            raise WorkerError(f"failed to load {path!r}: {reason}\n\nworker traceback:\n{tb}")
        n, slot, r = entry["n"], entry["slot"], self._ring
        return SlotView(r.images[slot, :n], r.labels[slot, :n],
                        None if r.meta is None else r.meta[slot, :n], None if r.arena is None else r.arena[slot, :n])

    def cancel(self) -> None:
        """Abandon every submitted batch (workers skip their chunks) and wait until their slots are free."""
        self._generation.value += 1
        while any(e["left"] for e in self._pending.values()):
            self._receive_one()
        self._pending.clear()

    def _receive_one(self) -> None:
        while True:
            try:
                gen, batch_id, _, error = self._results.get(timeout=_POLL_S)
                break
            except queue.Empty:
                self._check_alive()
        entry = self._pending.get(batch_id)
        if entry is None:
            return
        entry["left"] -= 1
        if error is not None and entry["error"] is None:
            entry["error"] = error

    def _check_alive(self) -> None:
        for i, p in enumerate(self._procs):
            if not p.is_alive():
                index = self._current[i]
                where = f" while loading {self._spec.source.path(index)!r}" if index >= 0 else ""
                self.close()
                raise WorkerError(
                    f"gpufeed worker {i} (pid {p.pid}) exited unexpectedly with code {p.exitcode}{where}"
                    " (a negative code is the signal that killed it, e.g. -9 for the out-of-memory killer)"
                )

    def close(self) -> None:
        """Stop the workers and free the shared memory (idempotent)."""
        self._finalizer()


def _shutdown(procs: list, tasks: Any, shm: shared_memory.SharedMemory) -> None:
    for p in procs:
        if p.is_alive():
            try:
                tasks.put(None)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(1.0)
    tasks.cancel_join_thread()
    shm.close()
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def default_num_workers(local_world_size: int = 1) -> int:
    """One worker per core available to this process, shared among the ranks of this node."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))
