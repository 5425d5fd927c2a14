"""A worker process, from its first instruction to its exit.

numpy and OpenCV each bring an OpenBLAS that starts a thread per core when it loads, in every process that
imports them. Workers never call BLAS (and OpenCV's own pool is held to one thread), so on a 16-core
machine each worker would carry 30 idle threads, and 16 workers per rank times 8 ranks on a 128-core node
some 32,000: enough to hit a container's process limit (OpenBLAS's "pthread_create failed"), and idle pools
cost the workers context switches (BENCHMARKS.md#worker-processes). PyTorch's DataLoader sets
``torch.set_num_threads(1)`` in its workers for the same reason. The thread counts are read when the
libraries load, so ``run`` sets them first: this module imports only the standard library, and the
pipeline spec (whose classes pull in numpy) arrives pickled and is unpickled after.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Any

from .records import ChunkDone, Progress

_MAIN = threading.Lock()
_MAIN_HELD: list = [0, None]  # (holders now, ``__main__.__spec__`` as the first of them found it)


@contextlib.contextmanager
def main_not_reimported(needed: bool = False):
    """Start processes without re-running the user's main script in them.

    spawn and forkserver children normally import ``__main__`` again (as ``__mp_main__``). For a training
    script that means PyTorch, the model and everything else it imports, about 300 MB more per worker
    (measured with 16 workers); for a script that converts a dataset at module level, without an ``if
    __name__ == "__main__":`` guard, it means starting the conversion again in every child, which
    multiprocessing refuses. Workers need only gpufeed's modules and what they are sent, so while they
    start, ``__main__`` reports itself as a module named "__main__", which multiprocessing does not
    re-import. Holders may overlap (two conversions in two threads): the last one out puts back what the
    first one found. ``needed``: something sent to the children is defined in the main script (a source
    class, a recipe op run in the workers), so the import is kept.
    """
    main = sys.modules.get("__main__")
    if main is None or needed:
        yield
        return
    with _MAIN:
        if _MAIN_HELD[0] == 0:
            _MAIN_HELD[1] = main.__dict__.get("__spec__")
            main.__spec__ = types.SimpleNamespace(name="__main__")
        _MAIN_HELD[0] += 1
    try:
        yield
    finally:
        with _MAIN:
            _MAIN_HELD[0] -= 1
            if _MAIN_HELD[0] == 0:
                main.__spec__ = _MAIN_HELD[1]


SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   "VECLIB_MAXIMUM_THREADS": "1"}
# Workers run at a lower CPU priority than the process that trains: with as many workers as cores, the
# training loop's own thread (which launches the GPU's work) still gets a core at once.
WORKER_NICE = 5
# glibc's malloc returns large blocks to the kernel as soon as they are freed, so the next sample
# page-faults the same memory back in (45% of a worker's time per GPU-bound sample:
# BENCHMARKS.md#worker-processes). Fixed thresholds keep blocks up to MMAP_THRESHOLD in the heap and up to
# TRIM_THRESHOLD of free heap top mapped.
MMAP_THRESHOLD = 8 << 20
TRIM_THRESHOLD = 64 << 20


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker is started with (pickled once, at process start)."""

    worker_id: int
    spec_pickle: bytes  # the PipelineSpec, unpickled after the thread limits are set
    shm_name: str  # the shared batch ring
    ring_shape: tuple[int, int, int]  # slots, batch size, image size
    cpus: frozenset[int] | None  # the CPUs to run on (None: those inherited)
    tasks: Any  # queue of ``Task`` (None: stop)
    results: Any  # queue of ``ChunkDone``
    progress: Progress
    generation: Any  # shared int: tasks of another generation are acknowledged, not served
    parent_alive: Any  # the read end of a pipe only the main process writes to: EOF once it is gone
    lifeline: Any  # the write end of a pipe only this worker holds: the main process reads EOF once it is gone


def run(args: WorkerArgs) -> None:
    """Serve chunks until None arrives, or until the main process is gone. SIGTERM and SIGINT are ignored:
    schedulers, torchrun and Ctrl-C send them to the whole process group, and the training process may be
    finishing a step and saving a checkpoint; the workers go when it goes."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    os.set_inheritable(args.lifeline.fileno(), False)  # what a source runs (os.system, ...) must not hold it
    exit_with_parent(args.parent_alive)
    os.environ.update(SINGLE_THREADED)
    _lower_priority()
    keep_heap()
    if args.cpus:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setaffinity(0, args.cpus)
    from .chunks import ChunkServer  # numpy, OpenCV and the decoders load now, with one-thread pools
    from ..decode.cpu import own_pixel_cap_only

    own_pixel_cap_only()  # this process is gpufeed's own: max_pixels, checked first, is the pixel cap here
    server = ChunkServer(pickle.loads(args.spec_pickle), args.shm_name, args.ring_shape)
    try:
        while True:
            task = args.tasks.get()
            if task is None:
                return
            failures = server.serve(task, args.progress) if task.generation == args.generation.value else []
            args.progress.clear()
            args.results.put(ChunkDone(task.generation, task.batch_id, task.chunk_id, failures, time.monotonic()))
    finally:
        server.close()


def exit_with_parent(parent_alive: Any) -> None:
    """Exit as soon as the main process is gone, however it went (SIGKILL included): orphaned workers would
    otherwise keep the forkserver, the resource tracker and with it the shared memory alive for good. A
    thread blocks on the pipe, whose write end only the main process holds, until it reads EOF."""

    def watch() -> None:
        try:
            parent_alive.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="gpufeed-parent-watch").start()


def keep_heap() -> None:
    """Keep freed sample-sized blocks mapped in this process (glibc ``mallopt``; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # a libc without mallopt
        libc = ctypes.CDLL(None)
        libc.mallopt(-1, TRIM_THRESHOLD)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.nice(WORKER_NICE)
