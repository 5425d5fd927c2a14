"""Many host-to-device copies queued with one driver call (``cuMemcpyBatchAsync``, CUDA 12.8 and later).

The GPU stage copies each CPU-decoded sample's rows from the ring to its place in the decode buffer: a
hundred copies or more per batch. Issued one by one from Python, each costs the interpreter lock, which
the training thread of the same process needs (BENCHMARKS.md#what-the-loaders-gpu-work-costs-the-training).
Here they are one call that runs without the lock. A driver without the call is detected once, and then
the caller copies one by one, as before.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

__all__ = ["BatchedCopy"]

_log = logging.getLogger("gpufeed")

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order
_REFUSED_FOR_GOOD = (1, 801)  # CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED: this driver will refuse every call


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


class BatchedCopy:
    """``copy(dsts, srcs, sizes, stream) -> bool``: queue ``len(sizes)`` copies from page-locked host memory to
    device memory on ``stream`` (a ``torch.cuda.Stream``) in one driver call. ``dsts``/``srcs``: (n,) uint64
    addresses, ``sizes``: (n,) byte counts. False when the driver has no such call or refused this one: the
    caller then copies one by one (copies the driver may have queued before refusing are made again, in
    stream order, with the same bytes). ``available`` says whether the call was found (and not refused as
    unsupported since)."""

    def __init__(self) -> None:
        self._fn, self._has_fail_index = _find()
        self._warned = False

    @property
    def available(self) -> bool:
        return self._fn is not None

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream) -> bool:
        n = len(sizes)
        if len(dsts) != n or len(srcs) != n:
            raise ValueError(f"{len(dsts)} destinations and {len(srcs)} sources for {n} sizes")
        fn = self._fn
        if fn is None:
            return False
        if not n:
            return True
        # the legacy default stream and a stream being captured into a graph are refused by the driver: this
        # call only, copied one by one
        if stream.cuda_stream == 0 or torch.cuda.is_current_stream_capturing():
            return False
        dsts = np.ascontiguousarray(dsts, np.uint64)
        srcs = np.ascontiguousarray(srcs, np.uint64)
        sizes = np.ascontiguousarray(sizes, np.uint64)
        attrs, first, fail = _Attributes(_SRC_ACCESS_ORDER_STREAM), ctypes.c_size_t(0), ctypes.c_size_t(0)
        args = [ctypes.c_void_p(dsts.ctypes.data), ctypes.c_void_p(srcs.ctypes.data), ctypes.c_void_p(sizes.ctypes.data),
                ctypes.c_size_t(n), ctypes.byref(attrs), ctypes.byref(first), ctypes.c_size_t(1)]
        if self._has_fail_index:
            args.append(ctypes.byref(fail))
        args.append(ctypes.c_void_p(stream.cuda_stream))
        status = fn(*args)  # ctypes lets the interpreter lock go for the call
        if status == 0:
            return True
        where = f" (copy {fail.value})" if self._has_fail_index else ""
        if status in _REFUSED_FOR_GOOD:  # refused for every batch: one by one from now on
            self._fn = None
            _log.warning("gpufeed: cuMemcpyBatchAsync returned %d%s; copying CPU-decoded rows one by one from now on",
                         status, where)
        elif not self._warned:  # another error (an earlier kernel's, say): the copies one by one will show it
            self._warned = True
            _log.warning("gpufeed: cuMemcpyBatchAsync returned %d%s; this batch's rows copied one by one", status, where)
        return False


def _find() -> tuple[object | None, bool]:
    """The driver's batched copy and whether it takes a failure index (the CUDA 12.8 form), or (None, False)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, False
    for name, fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return fn, fail_index
    return None, False
