"""The GPU stage's device side, one interface, chosen once: on CUDA the decoder threads, each on its own
stream, the events between them and the stage's (side) stream, page-locked host sources and the Triton kernel
(its reference without Triton): training's ``augment.fused`` or validation's ``augment.center_crop``
(``crop``); on a CPU device (tests, stand-in decoders) the same calls, run in order here.

Streams: a decode call's stream first waits for the work queued so far on the side stream (the buffer's last
reader, the batch's copies); the side stream waits for every call's event before the kernel (``collect``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..augment.center_crop import center_crop_reference, center_crop_triton, max_taps
from ..augment.fused import resized_crop_reference, resized_crop_triton, triton
from ..batched_copy import BatchedCopy
from ..decode.base import DecodeJob, GpuDecoder


class CudaDecoding:
    """The stage's device side on CUDA: decoder threads on their own streams, events between them and the
    current (side) stream, page-locked host sources, the Triton kernel (the reference without Triton)."""

    def __init__(self, decoders: list[GpuDecoder], device: torch.device, scale, shift, crop: str = "box") -> None:
        self.decoders, self.device, self.scale, self.shift = decoders, device, scale, shift
        # one thread per decoder (a decoder's calls never overlap), each on its own stream
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"gpufeed-decode-{k}") for k in range(len(decoders))]
        self._streams = [torch.cuda.Stream(device) for _ in decoders]
        self._scale_t, self._shift_t = torch.tensor(scale, device=device), torch.tensor(shift, device=device)
        self._buffer_stream: torch.cuda.Stream | None = None
        self._batched = BatchedCopy()  # the CPU-decoded rows' copies, one driver call per batch
        self._launch = self._center if crop == "center" else self._box  # the recipe's kernel, chosen once
        self._reference = _reference(crop)

    def order_buffers(self) -> None:
        """Called before a decode buffer is taken: if this stage is driven from another stream than last
        time, that stream first waits for the old one (the buffers' last readers)."""
        stream = torch.cuda.current_stream(self.device)
        if self._buffer_stream is not None and self._buffer_stream != stream:
            stream.wait_stream(self._buffer_stream)
        self._buffer_stream = stream

    def submit(self, jobs: list[tuple[int, DecodeJob]]) -> list[Future]:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))

        def run(k: int, job: DecodeJob) -> tuple[np.ndarray, torch.cuda.Event]:
            stream = self._streams[k]
            stream.wait_event(ready)
            ok = self.decoders[k].decode(job, stream)
            done = torch.cuda.Event()
            done.record(stream)
            return ok, done

        return [self._threads[k].submit(run, k, job) for k, job in jobs]

    def collect(self, results: list[tuple[np.ndarray, torch.cuda.Event]]) -> list[np.ndarray]:
        side = torch.cuda.current_stream(self.device)
        for _, done in results:
            side.wait_event(done)
        return [ok for ok, _ in results]

    def copy_rooms(self, slot, ids: np.ndarray, sizes: np.ndarray, flat: torch.Tensor, offsets: np.ndarray) -> bool:
        """The first ``sizes[k]`` bytes of sample ``ids[k]``'s pixel room (its pixels, where the slot has no
        rooms) to ``flat[offsets[k]:]``, on the current stream, in one driver call; False (nothing queued)
        where that cannot be (no batched copy in this driver, or a ring that is not page-locked)."""
        area = slot.rooms if slot.rooms is not None else slot.images
        if not self._batched.available or not torch.from_numpy(area).is_pinned():
            return False
        srcs = area.ctypes.data + ids.astype(np.uint64) * np.uint64(area.strides[0])
        dsts = flat.data_ptr() + offsets.astype(np.uint64)
        return self._batched.copy(dsts, srcs, sizes, torch.cuda.current_stream(self.device))

    def host(self, a: np.ndarray) -> torch.Tensor:
        """A host tensor for an H2D copy: the ring's own page-locked memory when it is (the scheduler
        reuses the slot after the copy), else a pinned copy (the caching host allocator keeps it until the
        copy ran)."""
        t = torch.from_numpy(a)
        return t if t.is_pinned() else t.pin_memory()

    @staticmethod
    def pinned(t: torch.Tensor) -> bool:
        return t.is_pinned()

    def kernel(self, flat: torch.Tensor, table: torch.Tensor, size: int, dst: torch.Tensor) -> None:
        if triton is None:
            self._reference(flat, table.to(self.device), size, self._scale_t, self._shift_t, dst)
        else:
            self._launch(flat, table, size, dst)

    def _rows(self, table: torch.Tensor) -> torch.Tensor:
        """The kernel's table ((B, 8) int64, host) on the device, copied on the current stream."""
        return self.host(table.numpy()).to(self.device, non_blocking=True)

    def _box(self, flat: torch.Tensor, table: torch.Tensor, size: int, dst: torch.Tensor) -> None:
        resized_crop_triton(flat, self._rows(table), size, self.scale, self.shift, dst)

    def _center(self, flat: torch.Tensor, table: torch.Tensor, size: int, dst: torch.Tensor) -> None:
        center_crop_triton(flat, self._rows(table), size, self.scale, self.shift, dst,
                           taps_at_most=max_taps(table.numpy()))


class HostDecoding:
    """The same stage on the CPU (a CPU device: tests and stand-in decoders): calls run here, in order."""

    def __init__(self, decoders: list[GpuDecoder], device: torch.device, scale, shift, crop: str = "box") -> None:
        self.decoders, self.device = decoders, device
        self._scale_t, self._shift_t = torch.tensor(scale), torch.tensor(shift)
        self._kernel = _reference(crop)

    def order_buffers(self) -> None:
        pass

    def submit(self, jobs: list[tuple[int, DecodeJob]]) -> list[Future]:
        futures = []
        for k, job in jobs:  # reported as the threads do: an error is raised when awaited
            f: Future = Future()
            try:
                f.set_result(self.decoders[k].decode(job, None))
            except Exception as e:
                f.set_exception(e)
            futures.append(f)
        return futures

    def collect(self, results: list[np.ndarray]) -> list[np.ndarray]:
        return results

    def host(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a)

    @staticmethod
    def pinned(t: torch.Tensor) -> bool:
        return True  # copies to the CPU read it in place

    @staticmethod
    def copy_rooms(*_: object) -> bool:
        return False  # copied one by one

    def kernel(self, flat: torch.Tensor, table: torch.Tensor, size: int, dst: torch.Tensor) -> None:
        self._kernel(flat, table, size, self._scale_t, self._shift_t, dst)


def _reference(crop: str):
    """The kernel's function in plain torch and numpy for ``crop`` ("box" or "center")."""
    return center_crop_reference if crop == "center" else resized_crop_reference
