"""Transfer: move batches to the device on a side stream, one or more batches ahead.

    host iterable ──pin──► side stream: H2D copy, transform ──event──► consumer stream
                                 (batch k+1 ... k+depth)            (batch k, training)

Stream contract (CUDA):
- One side stream per ``Prefetcher``, created once and reused across epochs.
- The consumer's current stream waits on the batch's event before it gets the
  batch, so kernels it launches see the finished copy and transform.
- Every device tensor handed over was allocated on the side stream; it is
  marked with ``record_stream(consumer)`` so the caching allocator does not
  give its memory to the side stream's next copy while consumer work that
  reads it is still queued.
- Host memory: tensors that are not pinned are first copied into pinned
  memory from PyTorch's caching host allocator, which itself keeps each block
  until the copy that reads it has finished. The source tensor may therefore
  be reused by its producer as soon as the next item is requested.

- ``on_issued(item)``, if given, is called in the thread that issues the copies, with the side stream
  current, once the item's copies and its transform (or the transform's ``start``) are queued: an event
  recorded on the current stream then completes when they have run, after which the producer may reuse
  the item's host memory (the loader hands ring slots back this way).

- ``on_take(waited)``, if given, is called in the consumer's thread as it takes each batch (CUDA):
  ``waited`` says whether none was ready, i.e. whether the consumer waited for this Prefetcher.

- Threads: on CUDA a background thread pulls from the iterable and issues
  the copies and the transform (GPU decode, for the GPU path), up to
  ``depth`` batches ahead; the consumer thread only waits on events. A
  transform split into ``start``/``finish`` runs one batch deeper: batch k+1
  is started (its decode handed to the decoder threads) before batch k is
  finished, so the decoders never wait for this thread. An
  exception in the iterable or the transform is re-raised in the consumer
  with its original traceback; leaving the loop early stops the thread and
  closes the iterable. With ``timeout``, the consumer waits at most that many
  seconds for each batch, then raises ``TimeoutError`` naming where the
  background thread is (its innermost frames).

Without CUDA (or for ``device="cpu"``) the same object applies ``transform``
and passes batches through, in the caller's thread: one API everywhere.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import sys
import threading
import traceback
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["Prefetcher", "prefetch"]


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists, dicts, namedtuples and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


class Prefetcher:
    """Iterate ``iterable`` with batches already on ``device`` (see the module docstring).

    ``transform(batch) -> batch`` runs on the device, on the side stream, after
    the copy (e.g. normalise, cast, channels_last). ``depth``: batches in
    flight ahead of the consumer. ``on_issued``, ``on_take``, ``timeout`` (seconds the consumer waits
    for one batch on CUDA; None: no limit): see the module docstring.
    Iterating it iterates ``iterable``; ``iterate(other)`` runs the same
    stream and settings over another iterable (one at a time).
    """

    def __init__(
        self,
        iterable: Iterable[Any] = (),
        device: str | torch.device = "cuda",
        *,
        depth: int = 2,
        transform: Callable[[Any], Any] | None = None,
        on_issued: Callable[[Any], None] | None = None,
        on_take: Callable[[bool], None] | None = None,
        timeout: float | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        self.timeout = timeout
        self.iterable = iterable
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.depth = depth
        self.transform = transform
        self.on_issued, self.on_take = on_issued, on_take
        self._stream: torch.cuda.Stream | None = None

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return self.iterate(self.iterable)

    def iterate(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Batches of ``iterable`` on the device (closing the returned iterator stops the work and closes
        ``iterable``'s iterator)."""
        if self.device.type != "cuda":
            return self._iter_host(iterable)
        return self._iter_cuda(iterable)

    def _iter_host(self, iterable: Iterable[Any]) -> Iterator[Any]:
        it = iter(iterable)
        try:
            for item in it:
                batch = _map_tensors(item, lambda t: t.to(self.device))
                batch = self.transform(batch) if self.transform else batch
                if self.on_issued is not None:
                    self.on_issued(item)
                yield batch
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _iter_cuda(self, iterable: Iterable[Any]) -> Iterator[Any]:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        handoff: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(iterable, handoff, stop), daemon=True,
                                  name="gpufeed-prefetch")
        thread.start()
        try:
            while True:
                waited = handoff.empty()
                try:
                    item = handoff.get(timeout=self.timeout)
                except queue.Empty:
                    raise TimeoutError(f"no batch within {self.timeout:g} s; the prefetch thread is at "
                                       f"{_where(thread)}") from None
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error  # carries the producer-side traceback
                if self.on_take is not None:
                    self.on_take(waited)
                event, batch = item
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_event(event)
                _map_tensors(batch, lambda t: _record(t, consumer))
                yield batch
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    handoff.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()

    def _produce(self, iterable: Iterable[Any], handoff: queue.Queue, stop: threading.Event) -> None:
        """Background thread: pull host batches, issue copy + transform on the side stream.

        A transform with ``start`` and ``finish`` (the GPU decode stage) is run one batch deep: batch k+1
        is started before batch k is finished, so work that ``start`` hands to other threads (the
        decoders) overlaps this thread's own. Every started batch is finished, also when the loop stops
        early or fails (``finish`` releases what ``start`` holds)."""
        torch.cuda.set_device(self.device)
        it = iter(iterable)
        stream = self._stream
        if hasattr(self.transform, "start") and hasattr(self.transform, "finish"):
            begin, end, lag = self.transform.start, self.transform.finish, 1
        else:
            begin, end, lag = self.transform, None, 0
        pending: collections.deque = collections.deque()  # started, not yet finished (at most ``lag``)
        try:
            for batch in it:
                pending.append(self._start(batch, stream, begin))
                if len(pending) > lag and not _put(handoff, self._finish(pending.popleft(), stream, end), stop):
                    return
            while pending:
                if not _put(handoff, self._finish(pending.popleft(), stream, end), stop):
                    return
            _put(handoff, _END, stop)
        except BaseException as e:  # handed to the consumer, which raises it
            _put(handoff, _Failure(e), stop)
        finally:
            for started in pending:  # stopped or failed with a batch started: finish it, drop the result
                try:
                    self._finish(started, stream, end)
                except BaseException:
                    pass
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _start(self, batch: Any, stream: torch.cuda.Stream, begin: Callable[[Any], Any] | None) -> Any:
        """On the side stream: the copies, then ``begin`` (the transform, or its ``start``)."""
        # Tensors already on the GPU were produced on the consumer stream: wait for them.
        on_gpu: list[bool] = []
        _map_tensors(batch, lambda t: on_gpu.append(t.is_cuda) or t)
        if any(on_gpu):
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            moved = _map_tensors(batch, self._to_device)
            started = begin(moved) if begin is not None else moved
            if self.on_issued is not None:
                self.on_issued(batch)
            return started

    def _finish(self, started: Any, stream: torch.cuda.Stream,
                end: Callable[[Any], Any] | None) -> tuple[torch.cuda.Event, Any]:
        """On the side stream: ``end`` (the transform's ``finish``, if it has one), then the event the
        consumer waits on."""
        with torch.cuda.stream(stream):
            batch = end(started) if end is not None else started
            event = torch.cuda.Event()
            event.record(stream)
        return event, batch

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)


_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _where(thread: threading.Thread) -> str:
    """The innermost frames of ``thread`` now, as one line."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "no frame (it has ended)"
    return " <- ".join(f"{f.name} ({f.filename}:{f.lineno})" for f in reversed(traceback.extract_stack(frame)[-4:]))


def _put(handoff: queue.Queue, item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            handoff.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _record(t: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    if t.is_cuda:
        t.record_stream(stream)
    return t


def prefetch(
    iterable: Iterable[Any],
    device: str | torch.device = "cuda",
    *,
    depth: int = 2,
    transform: Callable[[Any], Any] | None = None,
) -> Prefetcher:
    """Wrap any iterable of (nested) tensors so batches arrive on ``device`` ahead of time.

    >>> for images, labels in gpufeed.prefetch(DataLoader(ds, batch_size=256, num_workers=8)):
    ...     loss = model(images).sum()
    """
    return Prefetcher(iterable, device, depth=depth, transform=transform)
