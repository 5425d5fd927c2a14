"""CPU worker processes and the shared-memory batch ring.

    main process                         worker processes (no torch imported)
    ------------                         ------------------------------------
    submit(batch) -> chunks --tasks-->   read bytes, decode, crop, resize, flip
                                         write uint8 pixels + labels into the slot
                                         (GPU path: write the JPEG bytes + crop box
                                         instead; odd images still finished here)
    collect(batch) <--------done------   report (batch, chunk, failures)

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

import contextlib
import ctypes
import dataclasses
import multiprocessing as mp
import os
import queue
import time
import sys
import traceback
import types
import weakref
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from . import worker_start
from .augment.cpu import decode_box_into, decode_box_rows_into
from .augment.params import AugmentSpec, CropBox
from .cores import usable_cores
from .decode.base import DecodeError
from .decode.cpu import CpuDecoder
from .decode.exif import read_orientation, swaps_axes
from .decode.jpeg_check import gpu_safe_jpeg
from .ring import KIND_BYTES, KIND_PIXELS, KIND_ROWS, Ring, SlotView, check_shm_space
from .sources.base import FileSource, Source
from .sources.shared import SharedFileSource

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
    on_error: str = "raise"  # "raise": stop at the first bad sample; "skip": report it and go on
    exif_orientation: bool = False  # apply EXIF orientation (default: ignore it, as torchvision does)
    # The structural JPEG check before a cropped or GPU decode. False only to measure what it costs
    # (benchmarks/check_cost.py): damaged JPEGs could then reach decoders that fill damage in silently.
    check_structure: bool = True
    # Which of a chunk's GPU-decodable samples the CPU's share takes: "ratio", the lowest CPU cost per
    # engine cost (``cheapest_on_cpu``); "cpu_cost", the lowest CPU cost alone (the rule before session 7).
    cpu_pick: str = "ratio"
    # The CPU's share hands the GPU its crop's decoded rows to resize (True), or resizes them itself (False,
    # the rule before session 8).
    rows_to_gpu: bool = True

    def __post_init__(self) -> None:
        if self.cpu_pick not in CPU_PICKS:
            raise ValueError(f"cpu_pick must be one of {CPU_PICKS}, got {self.cpu_pick!r}")


def _read(spec: PipelineSpec, index: int) -> tuple[str, bytes]:
    path = spec.source.path(index)
    try:
        return path, spec.source.read(index)
    except OSError as e:
        raise DecodeError(path, f"cannot read the file ({type(e).__name__}: {e.strerror or e})") from None


def _finish_on_cpu(spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, index: int, path: str,
                   data: bytes, out: np.ndarray, header: tuple[int, int, bool] | None = None,
                   orientation: int | None = None) -> None:
    """Decode, orient, crop, resize and flip one sample into ``out`` ((S, S, 3) uint8). ``header``
    (``decoder.header(data, path)``) and ``orientation`` when the caller has them already."""
    width, height, fast = header or decoder.header(data, path)
    if orientation is None:
        orientation = read_orientation(data) if spec.exif_orientation else 1
    if swaps_axes(orientation):
        width, height = height, width
    box = spec.augment.draw(width, height, seed=seed, epoch=epoch, index=index)
    decode_box_into(decoder, data, path, box, (width, height), fast, out, orientation)


def load_sample_into(
    spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, index: int, out: np.ndarray
) -> int:
    """Read, decode and augment sample ``index`` into ``out`` ((S, S, 3) uint8); return its label."""
    path, data = _read(spec, index)
    _finish_on_cpu(spec, decoder, seed, epoch, index, path, data, out)
    return spec.source.label(index)


@dataclass
class _Inspected:
    """A GPU-path sample read and looked at, not yet placed: whether a GPU decoder may take it, and then
    its crop box (None otherwise)."""

    index: int
    path: str
    data: bytes
    header: tuple[int, int, bool]
    orientation: int
    gpu_ok: bool
    box: CropBox | None

    def cpu_cost(self) -> float:
        """The CPU decode's cost, in relative units: the entropy-coded bytes down to the crop's last row
        (rows above are entropy-decoded too, rows below never) plus half the crop's pixels (IDCT, colour,
        resize). Measured against the cropped decoder's time on synthetic ImageNet-like files: r = 0.98."""
        box, height = self.box, self.header[1]
        return len(self.data) * (box.y + box.height) / height + 0.5 * box.width * box.height

    def engine_cost(self) -> float:
        """The NVJPG engines' cost in the same units as bytes: the file's bytes plus a per-image part worth
        ``ENGINE_BYTES_PER_IMAGE`` (on the H200: 0.28 ns per byte + 10.2 us per image, pixels barely
        count; ``benchmarks/engine_cost.py``, BENCHMARKS.md S6-9)."""
        return len(self.data) + ENGINE_BYTES_PER_IMAGE


ENGINE_BYTES_PER_IMAGE = 36_000
# ``PipelineSpec.cpu_pick`` -> the key by which ``cheapest_on_cpu`` ranks a chunk's samples (lowest first)
_PICK_KEYS = {"ratio": lambda s: s.cpu_cost() / s.engine_cost(), "cpu_cost": _Inspected.cpu_cost}
CPU_PICKS = tuple(_PICK_KEYS)


def inspect_sample(spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, index: int) -> _Inspected:
    """GPU path, first step: read sample ``index``, parse its header and decide whether a GPU decoder may
    take it (what none should: not JPEG, CMYK, larger than the capacity, failing ``gpu_safe_jpeg``:
    truncated, corrupt, progressive; or EXIF-rotated when rotation is on); draw its box if so."""
    path, data = _read(spec, index)
    header = width, height, fast = decoder.header(data, path)
    orientation = read_orientation(data) if spec.exif_orientation else 1
    gpu_ok = (fast and orientation == 1 and len(data) <= spec.gpu_bytes_capacity
              and (not spec.check_structure or gpu_safe_jpeg(data)))
    box = spec.augment.draw(width, height, seed=seed, epoch=epoch, index=index) if gpu_ok else None
    return _Inspected(index, path, data, header, orientation, gpu_ok, box)


def place_sample(spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, s: _Inspected, ring: "Ring",
                 slot: int, k: int, on_cpu: bool) -> int:
    """GPU path, second step: put the JPEG bytes and crop box at position ``k`` of the slot for GPU
    decode; or (``on_cpu``) decode the crop's rows here and leave them with the box for the GPU to
    resize (``KIND_ROWS``; when they fit in the position's pixel room, else as below); or (no GPU
    decoder may take it) decode, crop and resize it here. Its label."""
    width, height, fast = s.header
    box = s.box
    if s.gpu_ok and not on_cpu:
        ring.arena[slot, k, : len(s.data)] = np.frombuffer(s.data, np.uint8)
        ring.meta[slot, k] = (KIND_BYTES, len(s.data), width, height, box.x, box.y, box.width, box.height,
                              int(box.flip))
        return spec.source.label(s.index)
    if s.gpu_ok:  # the CPU's share: a plain JPEG that passed the structural check, its box drawn already
        rows = decode_box_rows_into(decoder, s.data, s.path, box, (width, height), spec.augment.image_size,
                                    ring.rooms[slot, k]) if spec.rows_to_gpu else None
        if rows is not None:
            w, h, x, y, bw, bh = rows
            ring.meta[slot, k] = (KIND_ROWS, w * h * 3, w, h, x, y, bw, bh, int(box.flip))
            return spec.source.label(s.index)
        decode_box_into(decoder, s.data, s.path, box, (width, height), fast, ring.images[slot, k])
    else:
        _finish_on_cpu(spec, decoder, seed, epoch, s.index, s.path, s.data, ring.images[slot, k], s.header,
                       s.orientation)
    ring.meta[slot, k] = (KIND_PIXELS, 0, width, height, 0, 0, 0, 0, 0)
    return spec.source.label(s.index)


def encode_sample_into(
    spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, index: int, ring: "Ring", slot: int, k: int,
    on_cpu: bool = False,
) -> int:
    """GPU path, one sample: ``inspect_sample`` then ``place_sample``; its label."""
    return place_sample(spec, decoder, seed, epoch, inspect_sample(spec, decoder, seed, epoch, index), ring, slot,
                        k, on_cpu)


def cheapest_on_cpu(samples: dict[int, _Inspected], quota: int, pick: str = "ratio") -> set[int]:
    """The keys of the ``quota`` samples (all GPU-decodable) the CPU's part of a chunk takes: those with
    the lowest ``cpu_cost / engine_cost`` (``pick="ratio"``: the CPU takes what costs it least for what it
    saves the engines, so neither side is left the other's expensive files), or the lowest ``cpu_cost``.
    The engines' cost follows the file's bytes whatever the box, the cropped CPU decode's follows the box."""
    key = _PICK_KEYS.get(pick)
    if key is None:
        raise ValueError(f"cpu_pick must be one of {CPU_PICKS}, got {pick!r}")
    return set(sorted(samples, key=lambda k: key(samples[k]))[: max(0, quota)])


def _worker_main(
    worker_id: int,
    spec: PipelineSpec,
    shm_name: str,
    ring_shape: tuple[int, int, int],
    tasks: Any,
    results: Any,
    progress: Any,
    generation: Any,
    cpus: set[int] | None = None,
    map_bytes: int = 0,
) -> None:
    """Serve chunks until None arrives. ``progress[worker_id]`` holds (batch, chunk, position, start
    time) of the sample in hand, so the main process can name it if this process dies or hangs.
    ``cpus``: the CPUs this process runs on (None: those it inherited); ``map_bytes``: ``Ring.map_pages``'s
    bytes per arena position (0: none; the ring's pixels and labels are mapped whenever it is > 0)."""
    _lower_priority()
    _keep_heap()
    if cpus:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setaffinity(0, cpus)
    shm = shared_memory.SharedMemory(name=shm_name)
    ring = Ring(shm, *ring_shape, spec.gpu_bytes_capacity)
    if map_bytes:
        ring.map_pages(map_bytes)
    decoder = CpuDecoder(max_pixels=spec.max_pixels, check_structure=spec.check_structure)
    mine = progress[worker_id]
    try:
        while True:
            task = tasks.get()
            if task is None:
                return
            gen, batch_id, chunk_id, slot, seed, epoch, start, indices, cpu_quota = task
            failures = []
            if gen == generation.value:  # stale chunks of an abandoned epoch are acknowledged, not decoded
                failures = _serve_chunk(spec, decoder, ring, mine, batch_id, chunk_id, slot, seed, epoch, start,
                                        indices, cpu_quota)
            mine[:] = (-1, -1, -1, 0.0)
            results.put((gen, batch_id, chunk_id, failures))
    except KeyboardInterrupt:
        return
    finally:
        del ring
        shm.close()


def _serve_chunk(spec: PipelineSpec, decoder: CpuDecoder, ring: Ring, mine: Any, batch_id: int, chunk_id: int,
                 slot: int, seed: int, epoch: int, start: int, indices: list[int], cpu_quota: int) -> list:
    """Load one chunk into slot positions ``start...``; its failures as (position, path, reason, traceback).
    ``mine`` is kept at the sample in hand. On the GPU path the whole chunk is looked at first (files no
    GPU decoder takes are finished then), then the CPU decodes the rest of its ``cpu_quota`` from the
    chunk's cheapest samples (``cheapest_on_cpu``) and the others are left encoded."""
    failures: list = []
    stop = lambda: failures and spec.on_error == "raise"

    def attempt(k, index, fn, *args):  # a failure is reported to the main process, which applies the policy
        mine[:] = (batch_id, chunk_id, k, time.monotonic())
        try:
            return fn(*args)
        except Exception as e:
            tb = traceback.format_exc() if spec.on_error == "raise" else ""
            failures.append((k, spec.source.path(index), f"{type(e).__name__}: {e}", tb))
            return None

    def settle(k, index, fn, *args):  # ``attempt`` for a function returning the sample's label
        label = attempt(k, index, fn, *args)
        if label is not None:
            ring.labels[slot, k] = label

    if not spec.gpu_bytes_capacity:
        for k, index in enumerate(indices, start):
            settle(k, index, load_sample_into, spec, decoder, seed, epoch, index, ring.images[slot, k])
            if stop():
                break
        return failures
    gpu_ok: dict[int, _Inspected] = {}  # position -> a sample a GPU decoder may take (bytes held until placed)
    forced = 0
    for k, index in enumerate(indices, start):
        sample = attempt(k, index, inspect_sample, spec, decoder, seed, epoch, index)
        if sample is not None and sample.gpu_ok:
            gpu_ok[k] = sample
        elif sample is not None:  # no GPU decoder takes it: finished here at once, counted in the CPU's part
            forced += 1
            settle(k, index, place_sample, spec, decoder, seed, epoch, sample, ring, slot, k, True)
        if stop():
            return failures
    on_cpu = cheapest_on_cpu(gpu_ok, cpu_quota - forced, spec.cpu_pick)
    for k, sample in gpu_ok.items():
        settle(k, sample.index, place_sample, spec, decoder, seed, epoch, sample, ring, slot, k, k in on_cpu)
        if stop():
            break
    return failures


# Bytes of each arena position every process maps at start (``Ring.map_pages``): files up to this size are
# written and read without page faults; larger ones fault in the rest. 0: map nothing ahead.
RING_MAP_BYTES = 256 << 10
WORKER_NICE = 5
# glibc's malloc returns large blocks to the kernel as soon as they are freed (blocks over a threshold that
# adapts to the sizes seen are mmapped, the heap's free top is trimmed past another); a worker frees a
# file's bytes and a decoded image every sample, so the next sample page-faults the same memory back in:
# 45% of a worker's time per GPU-bound sample on the development machine (87 vs 48 us). Fixed thresholds
# keep blocks up to MMAP_THRESHOLD in the heap and up to TRIM_THRESHOLD of free heap top mapped.
MMAP_THRESHOLD = 8 << 20
TRIM_THRESHOLD = 64 << 20


def _keep_heap() -> None:
    """Keep freed sample-sized blocks mapped in this process (glibc ``mallopt``; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # a libc without mallopt
        libc = ctypes.CDLL(None)
        libc.mallopt(-1, TRIM_THRESHOLD)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD


def _lower_priority() -> None:
    """Workers run at a lower CPU priority than the process that trains: when there are as many workers
    as cores, the training loop's own thread (which launches the GPU's work) still gets a core at once."""
    with contextlib.suppress(OSError, AttributeError):
        os.nice(WORKER_NICE)


def check_source_importable(source: Source) -> None:
    """Worker processes unpickle the source, so its class must be importable there."""
    cls = type(source)
    if cls.__module__ == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        raise ValueError(
            f"source class {cls.__name__!r} is defined in an interactive session (a notebook or REPL), "
            "where worker processes cannot import it; define it in a .py module and import it from there"
        )


@contextlib.contextmanager
def _main_not_reimported(spec: PipelineSpec):
    """Start workers without re-running the user's main script in them.

    spawn and forkserver children normally import ``__main__`` again (as
    ``__mp_main__``), which for a training script means PyTorch, the model and
    everything else it imports: about 300 MB more per worker, measured with 16
    workers. Workers need only gpufeed.workers and the source, so while they
    start, ``__main__`` reports itself as a module named "__main__", which
    multiprocessing does not re-import. A source class defined in the main
    script itself needs that import, so then nothing is changed.
    """
    main = sys.modules.get("__main__")
    needs_main = type(spec.source).__module__ == "__main__"
    if main is None or needs_main:
        yield
        return
    saved = main.__dict__.get("__spec__")
    main.__spec__ = types.SimpleNamespace(name="__main__")
    try:
        yield
    finally:
        main.__spec__ = saved


def _default_context() -> mp.context.BaseContext:
    methods = mp.get_all_start_methods()
    return mp.get_context("forkserver" if "forkserver" in methods else "spawn")


class WorkerPool:
    """``num_workers`` processes filling a ring of ``num_slots`` batch slots.

    ``submit(batch_id, slot, seed, epoch, indices, start)`` queues samples for
    positions ``start, start + 1, ...`` of a slot; ``collect(batch_id)`` blocks
    until they are done and returns a ``SlotView`` and the failures, a list of
    ``Failure`` (position, path, reason). With ``on_error="raise"`` the first
    failure raises ``WorkerError`` instead.

    ``cpus`` (a set of CPU numbers) keeps the workers on those CPUs.

    A worker that dies, or holds one sample longer than ``sample_timeout``
    seconds, is reported within about a second: under "raise" as a
    ``WorkerError`` naming the worker and the file; under "skip" its sample is
    a failure, the rest of its chunk comes back as ``retry`` positions, and a
    fresh worker takes its place.
    """

    def __init__(self, spec: PipelineSpec, *, num_workers: int, num_slots: int, batch_size: int,
                 sample_timeout: float | None = None, cpus: set[int] | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if sample_timeout is not None and sample_timeout <= 0:
            raise ValueError(f"sample_timeout must be > 0 seconds or None, got {sample_timeout}")
        check_source_importable(spec.source)
        size = spec.augment.image_size
        self.num_slots, self.batch_size, self.size = num_slots, batch_size, size
        self.sample_timeout, self.cpus = sample_timeout, cpus
        self._chunk = max(1, -(-batch_size // (2 * num_workers)))  # ~2 chunks per worker per batch
        self.last_wait = 0.0
        self._ctx = ctx = _default_context()
        capacity = spec.gpu_bytes_capacity
        # the bytes the ring touches: all of it but the arena's room beyond typical JPEGs
        check_shm_space(Ring.nbytes(num_slots, batch_size, size, min(capacity, 512 << 10)))
        self._shm = shared_memory.SharedMemory(create=True, size=Ring.nbytes(num_slots, batch_size, size, capacity))
        self._ring = Ring(self._shm, num_slots, batch_size, size, capacity)
        self.map_bytes = RING_MAP_BYTES  # read here, so a benchmark may change it between pools
        if self.map_bytes:  # this process reads the arena (GPU decoders' host side) and the pixels
            self._ring.map_pages(self.map_bytes)
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._progress = [ctx.Array("d", [-1.0, -1.0, -1.0, 0.0], lock=False) for _ in range(num_workers)]
        self._generation = ctx.Value("q", 0, lock=False)
        self._blocks = [self._shm]
        if type(spec.source) is FileSource:  # one shared copy of the file list (subclasses may override read)
            shared, block = SharedFileSource.create(spec.source)
            spec = dataclasses.replace(spec, source=shared)
            self._blocks.append(block)
        self._spec = spec
        self._spec_pickle = bytes(ForkingPickler.dumps(spec))  # unpickled in the worker after its thread limits are set
        self._pending: dict[int, dict[str, Any]] = {}
        self._procs: list = []
        self._unpin: list = []  # cudaHostUnregister calls, run before the memory is unmapped
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._tasks, self._blocks, self._unpin)
        try:
            for i in range(num_workers):
                self._procs.append(self._start(i))
        except BaseException:  # a worker that cannot start: stop the others, free the shared memory
            self._finalizer()
            raise

    def _start(self, i: int):
        p = self._ctx.Process(
            target=worker_start.boot,  # limits the native thread pools, then runs _worker_main
            args=(i, self._spec_pickle, self._shm.name, (self.num_slots, self.batch_size, self.size), self._tasks,
                  self._results, self._progress, self._generation, self.cpus, self.map_bytes),
            daemon=True, name=f"gpufeed-worker-{i}")
        with _main_not_reimported(self._spec):
            p.start()
        return p

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def submit(self, batch_id: int, slot: int, seed: int, epoch: int, indices: list[int], start: int = 0,
               cpu_rows: int = 0) -> None:
        """Queue samples ``indices`` for slot positions ``start...``. On the GPU path, ``cpu_rows`` of them
        (the CPU's share) are decoded here rather than left encoded: spread evenly over the chunks, each
        chunk's worker takes those of its samples that are cheapest to decode on the CPU (small crop
        boxes near the top; ``cheapest_on_cpu``)."""
        chunks = [indices[i : i + self._chunk] for i in range(0, len(indices), self._chunk)]
        gen = self._generation.value
        self._pending[batch_id] = {"left": set(range(len(chunks))), "n": start + len(indices), "slot": slot,
                                   "failures": [], "chunks": {}}
        n = max(1, len(indices))
        for c, chunk in enumerate(chunks):
            a = c * self._chunk  # the chunk's first sample among ``indices``
            quota = round(cpu_rows * (a + len(chunk)) / n) - round(cpu_rows * a / n)
            self._pending[batch_id]["chunks"][c] = (start + a, chunk)
            self._tasks.put((gen, batch_id, c, slot, seed, epoch, start + a, chunk, quota))

    def collect(self, batch_id: int) -> tuple["SlotView", list["Failure"]]:
        """Wait for batch ``batch_id``; its slot's views and failures. ``last_wait``: seconds spent waiting
        for the workers' results (about 0 when the batch was ready)."""
        entry = self._pending[batch_id]
        self._check_workers()  # a dead worker is reported even if others finish its share
        self.last_wait = 0.0
        while entry["left"]:
            self._receive_one()
        del self._pending[batch_id]
        failures = sorted(entry["failures"])
        if failures and self._spec.on_error == "raise":
            f = failures[0]
            raise WorkerError(f"failed to load {f.path!r}: {f.reason}" + (f"\n\nworker traceback:\n{f.traceback}"
                                                                          if f.traceback else ""))
        return self._ring.slot(entry["slot"]).head(entry["n"]), failures

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def cancel(self) -> None:
        """Abandon every submitted batch (workers skip their chunks) and wait until their slots are free."""
        if self.closed:
            self._pending.clear()
            return
        self._generation.value += 1
        while any(e["left"] for e in self._pending.values()):
            self._receive_one()
        self._pending.clear()

    def _receive_one(self) -> None:
        """Take one result, or, after a quiet poll interval, check the workers (which may settle a
        chunk by itself when one died); callers loop until what they wait for is done."""
        t0 = time.perf_counter()
        try:
            gen, batch_id, chunk_id, failures = self._results.get(timeout=_POLL_S)
        except queue.Empty:
            self._check_workers()
            return
        finally:
            self.last_wait += time.perf_counter() - t0
        entry = self._pending.get(batch_id)
        if entry is None or chunk_id not in entry["left"]:
            return
        entry["left"].discard(chunk_id)
        entry["failures"] += [Failure(k, path, reason, tb) for k, path, reason, tb in failures]

    def _check_workers(self) -> None:
        now = time.monotonic()
        for i, p in enumerate(self._procs):
            batch_id, chunk_id, k, started = self._progress[i]
            busy = batch_id >= 0
            if p.is_alive() and not (busy and self.sample_timeout and now - started > self.sample_timeout):
                continue
            entry = self._pending.get(int(batch_id)) if busy else None
            first, chunk = entry["chunks"].get(int(chunk_id), (0, None)) if entry is not None else (0, None)
            path = self._spec.source.path(chunk[int(k) - first]) if chunk is not None else None
            if p.is_alive():
                p.kill()
                p.join(5)
                why = f"held one sample longer than sample_timeout={self.sample_timeout}s"
            else:
                why = (f"exited unexpectedly with code {p.exitcode} (a negative code is the signal that killed it,"
                       " e.g. -9 for the out-of-memory killer)")
            where = f" while loading {path!r}" if path else ""
            if self._spec.on_error == "raise" or entry is None:
                self.close()
                raise WorkerError(f"gpufeed worker {i} (pid {p.pid}) {why}{where}")
            # skip: that sample fails, the rest of its chunk is retried, a new worker takes over
            entry["left"].discard(int(chunk_id))
            entry["failures"].append(Failure(int(k), path, f"worker {why}", ""))
            entry["failures"] += [Failure(j, None, "retry", "") for j in range(int(k) + 1, first + len(chunk))]
            self._progress[i][:] = [-1.0, -1.0, -1.0, 0.0]
            self._procs[i] = self._start(i)  # the finalizer holds this same list

    def pin_images(self) -> bool:
        """Page-lock the ring's pixel area (images; on the GPU path each position's whole pixel room) for
        CUDA (``cudaHostRegister``), so that host-to-device copies read a finished slot directly instead of
        through a staging copy. Returns whether it worked (it needs CUDA; without it copies stage through
        pinned buffers as before). A pinned slot is reused only after the copies that read it completed
        (the caller's events)."""
        import torch

        pixels = self._ring.pixels
        rt = torch.cuda.cudart()
        if int(rt.cudaHostRegister(pixels.ctypes.data, pixels.nbytes, 0)) != 0:
            return False
        self._unpin.append(lambda ptr=pixels.ctypes.data: rt.cudaHostUnregister(ptr))
        return True

    def close(self) -> None:
        """Stop the workers and free the shared memory (idempotent)."""
        self._finalizer()


@dataclass(frozen=True, order=True)
class Failure:
    """A sample that did not load: its position in the slot, its file and why.
    ``reason == "retry"`` marks a good sample left undone by a worker that died."""

    position: int
    path: str | None
    reason: str
    traceback: str = ""


def _shutdown(procs: list, tasks: Any, blocks: list, unpin: list) -> None:
    for undo in unpin:
        with contextlib.suppress(Exception):  # CUDA may already be shut down at interpreter exit
            undo()
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
    for block in blocks:
        try:
            block.close()
        except BufferError:  # numpy views still alive here: the mapping goes with them
            pass
        try:
            block.unlink()
        except FileNotFoundError:
            pass


def default_num_workers(local_world_size: int = 1) -> int:
    """One worker per core this process may use (affinity mask and cgroup CPU quota,
    ``cores.usable_cores``), shared among the ranks of this node."""
    return max(1, usable_cores() // max(1, local_world_size))
