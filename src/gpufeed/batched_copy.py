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

__all__ = ["BatchedCopy"]

_log = logging.getLogger("gpufeed")

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


class BatchedCopy:
    """``copy(dsts, srcs, sizes, stream) -> bool``: queue ``len(sizes)`` copies from page-locked host memory to
    device memory on ``stream`` (a ``torch.cuda.Stream``) in one driver call. ``dsts``/``srcs``: (n,) uint64
    addresses, ``sizes``: (n,) byte counts. False when the driver has no such call or refused this one (the
    caller then copies one by one; nothing was queued). ``available`` says whether the call was found."""

    def __init__(self) -> None:
        self._fn, self._has_fail_index = _find()

    @property
    def available(self) -> bool:
        return self._fn is not None

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream) -> bool:
        fn = self._fn
        if fn is None:
            return False
        n = len(sizes)
        if not n:
            return True
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
        if status != 0:
            # an argument the driver refuses is refused for every batch: copy one by one from now on
            _log.warning("gpufeed: cuMemcpyBatchAsync returned %d; copying CPU-decoded rows one by one", status)
            self._fn = None
            return False
        return True


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
