"""The worker pool: processes that fill the shared batch ring, and what the main process knows of them.

    main process                          worker processes (no torch imported)
    ------------                          ------------------------------------
    submit(batch) -> Task per chunk -->   read, decode, crop, resize, flip (CPU path);
                                          bytes + crop box, or the crop's rows (GPU path)
                                          into the batch's ring slot
    collect(batch) <----- ChunkDone ----  failures, if any

A batch is split into chunks that any idle worker takes from one queue. A slot belongs to the main process
from ``collect`` until the caller hands it out again; the caller must not read a slot's views after that.
Workers start through ``forkserver`` on Linux (safe with CUDA initialised in the parent, and usable from
Jupyter), ``spawn`` elsewhere. They are stopped by ``close``, by garbage collection of the pool, or at
interpreter exit, and exit by themselves as soon as the main process is gone (``process.run``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from multiprocessing import connection as mp_connection
from multiprocessing import shared_memory
from multiprocessing import util as mp_util
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ..ring import Ring, SlotView, check_shm_space
from ..sources.base import FileSource, Source
from ..sources.shared import SharedFileSource
from .chunks import PipelineSpec
from .process import WorkerArgs, main_not_reimported, run
from .records import RETRY, ChunkDone, Failure, OutputSize, Progress, Task, WorkerError

# How often a waiting main process checks that its workers are alive and within ``sample_timeout``.
_POLL_S = 0.5


class _Worker:
    """A worker process and the read end of a pipe whose write end only that process holds: EOF there means
    the process is gone, however it went. Its liveness is read from that pipe, not from ``Process.is_alive``:
    under forkserver that asks the fork server, which dies when torchrun or a batch scheduler sends SIGTERM
    to the whole process group; after that every worker it started reads as exited with code 255, though
    the workers ignore SIGTERM and run on."""

    def __init__(self, process: Any, lifeline: Any) -> None:
        self.process, self.lifeline = process, lifeline

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        """False once gone, or once ``close`` (after it was seen gone, or killed). On POSIX the pid is asked
        too: a process the worker started through a plain fork would hold the pipe open after it."""
        if self.lifeline.closed:
            return False
        try:
            if self.lifeline.poll():
                return False
        except OSError:  # a broken pipe (Windows) is the writer gone
            return False
        if os.name == "posix":
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
        return True

    def wait(self, timeout: float) -> bool:
        """Whether the process is gone within ``timeout`` seconds (at once after ``close``)."""
        return self.lifeline.closed or bool(mp_connection.wait([self.lifeline], timeout)) or not self.alive()

    def kill(self) -> None:
        """SIGKILL (TerminateProcess on Windows), and wait up to 5 s for it to take; ``Process.kill`` would send
        nothing once the fork server is gone."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, getattr(signal, "SIGKILL", signal.SIGTERM))
            self.wait(5.0)
        self.process.join(0.1)  # reaped where this process is its parent (spawn)

    def exitcode(self) -> int | None:
        """A gone process's exit code, as multiprocessing reports it (255 if the fork server went first)."""
        self.process.join(1.0)
        return self.process.exitcode

    def close(self) -> None:
        self.lifeline.close()


@dataclasses.dataclass
class _Pending:
    """A submitted batch: its slot, how many positions it fills, its image size, the chunks not yet done
    (chunk id -> (first position, indices)), the failures reported so far, and when its last chunk reported
    so far was finished (``time.monotonic()``)."""

    slot: int
    n: int
    size: int
    chunks: dict[int, tuple[int, list[int]]]
    left: set[int]
    failures: list[Failure] = dataclasses.field(default_factory=list)
    finished: float = 0.0


class WorkerPool:
    """``num_workers`` processes filling a ring of ``num_slots`` batch slots.

    ``submit(batch_id, slot, seed, epoch, indices, start, size=...)`` queues samples for positions ``start,
    start + 1, ...`` of a slot, at the pool's image size or a smaller one; ``collect(batch_id)`` blocks until
    they are done and returns a ``SlotView`` and the failures (``Failure``: position, path, reason). With
    ``on_error="raise"`` the first failure raises ``WorkerError`` instead. ``cpus`` (a set of CPU numbers)
    keeps the workers on those CPUs.

    A worker that dies, or holds one sample longer than ``sample_timeout`` seconds, is reported within
    about a second: under "raise" as a ``WorkerError`` naming the worker and the file; under "skip" its
    sample is a failure, the rest of its chunk comes back as ``RETRY`` positions, and a fresh worker takes
    its place. A batch not collected within ``batch_timeout`` seconds of the ``collect`` call (however its
    samples each fare) stops the pool with a ``WorkerError`` naming the workers on it and the samples in
    flight; ``cancel`` gives up waiting after as long and stops the pool.
    """

    def __init__(self, spec: PipelineSpec, *, num_workers: int, num_slots: int, batch_size: int,
                 sample_timeout: float | None = None, cpus: set[int] | None = None,
                 batch_timeout: float | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        for name, value in (("sample_timeout", sample_timeout), ("batch_timeout", batch_timeout)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 seconds or None, got {value}")
        check_source_importable(spec.source)
        size = spec.augment.image_size
        self.num_slots, self.batch_size, self.size = num_slots, batch_size, size
        self.sample_timeout, self.batch_timeout, self.cpus = sample_timeout, batch_timeout, cpus
        self.chunk_size = max(1, -(-batch_size // (2 * num_workers)))  # ~2 chunks per worker per batch
        self.last_wait = 0.0  # see collect
        self._ctx = ctx = _default_context()
        capacity = spec.gpu_bytes_capacity
        # the bytes the ring touches: all of it but the arena's room beyond typical JPEGs
        output = spec.normalize.layout if spec.normalize is not None else None
        check_shm_space(Ring.nbytes(num_slots, batch_size, size, min(capacity, 512 << 10), output))
        self._shm = shared_memory.SharedMemory(create=True,
                                               size=Ring.nbytes(num_slots, batch_size, size, capacity, output))
        self._ring = Ring(self._shm, num_slots, batch_size, size, capacity, output)
        self._ring.map_pages()  # this process reads the arena (GPU decoders' host side) and the pixels
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._progress = [Progress.create(ctx) for _ in range(num_workers)]
        self._generation = ctx.Value("q", 0, lock=False)
        # held here only: when this process dies, however it dies, the workers read EOF and exit
        self._alive_r, self._alive_w = ctx.Pipe(duplex=False)
        self._blocks = [self._shm]
        if type(spec.source) is FileSource:  # one shared copy of the file list (subclasses may override read)
            shared, block = SharedFileSource.create(spec.source)
            spec = dataclasses.replace(spec, source=shared)
            self._blocks.append(block)
        self._spec = spec
        self._spec_pickle = bytes(ForkingPickler.dumps(spec))
        self._pending: dict[int, _Pending] = {}
        self._workers: list[_Worker] = []
        self._unpin: list = []  # cudaHostUnregister calls, run before the memory is unmapped
        self.page_locked = False  # ``pin_images`` worked
        # multiprocessing's own finalizer, with an exit priority: at interpreter exit it runs before
        # multiprocessing terminates and joins its daemon children, which would wait forever for workers
        # that ignore SIGTERM; on garbage collection or close() it runs at once
        self._finalizer = mp_util.Finalize(self, _shutdown, (self._workers, self._tasks, self._blocks, self._unpin,
                                                             self._alive_w), exitpriority=10)
        try:
            for i in range(num_workers):
                self._workers.append(self._start(i))
        except BaseException:  # a worker that cannot start: stop the others, free the shared memory
            self._finalizer()
            raise

    def _start(self, i: int) -> _Worker:
        lifeline, held = self._ctx.Pipe(duplex=False)
        args = WorkerArgs(i, self._spec_pickle, self._shm.name, (self.num_slots, self.batch_size, self.size),
                          frozenset(self.cpus) if self.cpus else None, self._tasks, self._results,
                          self._progress[i], self._generation, self._alive_r, held)
        p = self._ctx.Process(target=run, args=(args,), daemon=True, name=f"gpufeed-worker-{i}")
        try:
            with main_not_reimported(self._spec.needs_main):
                p.start()
        except BaseException:
            lifeline.close()
            raise
        finally:
            held.close()  # the worker's copy is now the only one
        return _Worker(p, lifeline)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None]

    def submit(self, batch_id: int, slot: int, seed: int, epoch: int, indices: list[int], start: int = 0,
               cpu_rows: int = 0, size: OutputSize | None = None) -> None:
        """Queue samples ``indices`` for slot positions ``start...``, made at ``size`` (None: the size the
        pool was made for; a smaller one is laid out in the slot as ``Ring.at`` says). On the GPU path,
        ``cpu_rows`` of them (the CPU's share) are decoded here rather than left encoded: spread evenly over
        the chunks, each chunk's worker takes the ones ``placement.cheapest_on_cpu`` picks."""
        augment = self._spec.augment
        size = size or OutputSize(augment.image_size, augment.resize_size)
        self._ring.at(size.image)  # over the ring's size: raises here, not in a worker
        chunks = [indices[i : i + self.chunk_size] for i in range(0, len(indices), self.chunk_size)]
        gen = self._generation.value
        entry = self._pending[batch_id] = _Pending(slot, start + len(indices), size.image, {},
                                                   set(range(len(chunks))))
        n = max(1, len(indices))
        for c, chunk in enumerate(chunks):
            a = c * self.chunk_size  # the chunk's first sample among ``indices``
            quota = round(cpu_rows * (a + len(chunk)) / n) - round(cpu_rows * a / n)
            entry.chunks[c] = (start + a, chunk)
            self._tasks.put(Task(gen, batch_id, c, slot, seed, epoch, start + a, chunk, quota, size))

    def collect(self, batch_id: int) -> tuple[SlotView, list[Failure]]:
        """Wait for batch ``batch_id``; its slot's views and failures. ``last_wait``: seconds from this call to
        the moment the workers finished the batch (0 when they had finished before). It is read from the
        workers' own clock, so time this thread spent waiting for the interpreter lock, which the training
        thread holds much of the time, never counts as the workers being late."""
        entry = self._pending[batch_id]
        asked = time.monotonic()
        self._check_workers()  # a dead worker is reported even if others finish its share
        while entry.left:
            if self.batch_timeout is not None and time.monotonic() - asked > self.batch_timeout:
                self._overdue(batch_id, entry, time.monotonic() - asked)
            self._receive_one()
        self.last_wait = max(0.0, entry.finished - asked)
        del self._pending[batch_id]
        failures = sorted(entry.failures)
        if failures and self._spec.raises:
            f = failures[0]
            skip = "ImageLoader(on_error='skip') skips such files and lists them in loader.stats['skipped']"
            # the way out last too, where a terminal shows it: under the worker's traceback
            raise WorkerError(f"failed to load {f.path!r}: {f.reason} ({skip})"
                              + (f"\n\nworker traceback:\n{f.traceback.rstrip()}\n\n{f.path!r}: {skip}"
                                 if f.traceback else ""))
        return self._ring.at(entry.size).slot(entry.slot).head(entry.n), failures

    @property
    def closed(self) -> bool:
        return not self._finalizer.still_active()

    def cancel(self) -> None:
        """Abandon every submitted batch (workers skip their chunks) and wait until their slots are free."""
        if self.closed:
            self._pending.clear()
            return
        self._generation.value += 1
        asked = time.monotonic()
        while any(e.left for e in self._pending.values()):
            if self.batch_timeout is not None and time.monotonic() - asked > self.batch_timeout:
                self.close()  # workers that never answer: stopped, fresh ones next time
                break
            self._receive_one()
        self._pending.clear()

    def _overdue(self, batch_id: int, entry: _Pending, waited: float) -> None:
        """Stop the pool and raise ``WorkerError`` for batch ``batch_id``, not done after ``waited`` seconds:
        which worker holds which of its samples and since when, and its samples no worker has taken yet."""
        now, held, taken = time.monotonic(), [], set()
        for i, w in enumerate(self._workers):
            hand = self._progress[i].read()
            if hand is None or hand.batch_id != batch_id or hand.chunk_id not in entry.left:
                continue
            first, chunk = entry.chunks[hand.chunk_id]
            taken.add(hand.chunk_id)
            held.append(f"worker {i} (pid {w.pid}) on {self._spec.source.path(chunk[hand.position - first])!r} "
                        f"for {now - hand.since:.0f} s")
        queued = [i for c in sorted(entry.left - taken) for i in entry.chunks[c][1]]
        names = ", ".join(repr(self._spec.source.path(i)) for i in queued[:5]) + (" ..." if len(queued) > 5 else "")
        self.close()
        raise WorkerError(f"gpufeed: a batch was not done within batch_timeout={self.batch_timeout}s "
                          f"({waited:.0f} s): {'; '.join(held) or 'no worker is on it'}"
                          + (f"; not taken by any worker yet: {len(queued)} sample(s), {names}" if queued else ""))

    def _receive_one(self) -> None:
        """Take one result, or, after a quiet poll interval, check the workers (which may settle a chunk by
        itself when one died); callers loop until what they wait for is done."""
        try:
            done: ChunkDone = self._results.get(timeout=_POLL_S)
        except queue.Empty:
            self._check_workers()
            return
        entry = self._pending.get(done.batch_id)
        if entry is None or done.chunk_id not in entry.left:
            return
        entry.left.discard(done.chunk_id)
        entry.failures += done.failures
        entry.finished = max(entry.finished, done.finished)

    def _check_workers(self) -> None:
        now = time.monotonic()
        for i, w in enumerate(self._workers):
            alive = w.alive()  # first: a dead worker's record no longer changes, so the read below is its last sample
            held = self._progress[i].read()
            if alive and not (held and self.sample_timeout and now - held.since > self.sample_timeout):
                continue
            entry = self._pending.get(held.batch_id) if held else None
            first, chunk = entry.chunks.get(held.chunk_id, (0, None)) if entry is not None else (0, None)
            path = self._spec.source.path(chunk[held.position - first]) if chunk is not None else None
            if alive:
                w.kill()
                why = f"held one sample longer than sample_timeout={self.sample_timeout}s"
            else:
                why = (f"exited unexpectedly with code {w.exitcode()} (a negative code is the signal that killed "
                       "it, e.g. -9 for the out-of-memory killer)")
                if w.exitcode() == 1 and self._spec.needs_main:  # multiprocessing's bootstrapping error, most often
                    why += (f"; the workers import the training script {_main_file()!r}, where the recipe's op or the "
                            "source is defined: its code that makes loaders must run under if __name__ == "
                            "'__main__': (its traceback is printed above)")
            where = f" while loading {path!r}" if path else ""
            if self._spec.raises or entry is None:
                self.close()
                raise WorkerError(f"gpufeed worker {i} (pid {w.pid}) {why}{where}")
            # skip: that sample fails, every other position of its chunk is loaded again (the chunk's report,
            # with any earlier failure in it, died with the worker), and a new worker takes over
            entry.left.discard(held.chunk_id)
            entry.finished = max(entry.finished, now)  # settled now: as late as that (the CPU share's rule)
            entry.failures.append(Failure(held.position, path, f"worker {why}"))
            entry.failures += [Failure(j, None, RETRY) for j in range(first, first + len(chunk)) if j != held.position]
            self._progress[i].clear()
            self._workers[i] = self._start(i)  # the finalizer holds this same list
            w.close()  # after: a replacement that cannot start leaves the dead worker for the finalizer

    def pin_images(self) -> bool:
        """Page-lock the ring's pixel area (on the GPU path each position's whole pixel room) for CUDA
        (``cudaHostRegister``), so that host-to-device copies read a finished slot directly instead of
        through a staging copy. Returns whether it worked (it needs CUDA; without it copies stage through
        pinned buffers). A pinned slot is reused only after the copies that read it completed (the
        scheduler's events)."""
        import torch

        pixels = self._ring.pixels
        rt = torch.cuda.cudart()
        if int(rt.cudaHostRegister(pixels.ctypes.data, pixels.nbytes, 0)) != 0:
            return False
        self._unpin.append(lambda ptr=pixels.ctypes.data: rt.cudaHostUnregister(ptr))
        self.page_locked = True
        return True

    def close(self) -> None:
        """Stop the workers and free the shared memory (idempotent)."""
        self._finalizer()


def _shutdown(workers: list[_Worker], tasks: Any, blocks: list, unpin: list, alive_w: Any) -> None:
    for undo in unpin:
        with contextlib.suppress(Exception):  # CUDA may already be shut down at interpreter exit
            undo()
    for w in workers:
        if w.alive():
            try:
                tasks.put(None)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        w.wait(max(0.0, deadline - time.monotonic()))
    alive_w.close()  # any worker still busy exits now (it ignores SIGTERM)
    for w in workers:
        if not w.wait(1.0):
            w.kill()  # and reaps it
        else:
            w.process.join(0.1)  # reaped where this process is its parent (spawn)
        w.close()
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


def check_source_importable(source: Source) -> None:
    """Worker processes unpickle the source, so its class must be importable there."""
    cls = type(source)
    if cls.__module__ == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        raise ValueError(
            f"source class {cls.__name__!r} is defined in an interactive session (a notebook or REPL), "
            "where worker processes cannot import it; define it in a .py module and import it from there"
        )


def _default_context() -> mp.context.BaseContext:
    methods = mp.get_all_start_methods()
    return mp.get_context("forkserver" if "forkserver" in methods else "spawn")


def _main_file() -> str:
    """The training script's file, as the workers import it."""
    return str(getattr(sys.modules.get("__main__"), "__file__", None) or "__main__")
