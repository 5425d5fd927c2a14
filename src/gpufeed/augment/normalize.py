"""Once per batch, on the target device: uint8 NHWC to normalised float NCHW."""

from __future__ import annotations

import math
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ..buffers import ReusePool
from .fused import normalize_constants
from .in_workers import WorkerNormalize

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Normalize:
    """(B, S, S, 3) uint8 -> (B, 3, S, S) ``dtype``, ``(x / 255 - mean) / std``, on the input's device.

    ``channels_last=True`` returns the channels_last memory format, which is the
    NHWC input's own layout, so no transpose is paid; False returns contiguous NCHW.
    Labels and anything else in the batch pass through.
    """

    mean: Sequence[float] = IMAGENET_MEAN
    std: Sequence[float] = IMAGENET_STD
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype}")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"mean and std need 3 values (RGB), got {list(self.mean)} and {list(self.std)}")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std must be > 0, got {list(self.std)}")

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(3,) float32 scale and shift on ``device``, made once per device rather than per batch
        (on CUDA each would otherwise be a small blocking host-to-device copy on the hot path)."""
        if device not in self._cache:
            scale, shift = normalize_constants(self.mean, self.std)
            self._cache[device] = (torch.tensor(scale, device=device), torch.tensor(shift, device=device))
        return self._cache[device]

    def images(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[-1] != 3:
            raise ValueError(f"expected (B, H, W, 3) uint8, got {tuple(x.shape)} {x.dtype}")
        # Arithmetic in float32, then one cast: bf16/fp16 round once, not at every step.
        scale, shift = self._constants(x.device)
        if x.device.type == "cpu":
            out = self._on_cpu(np.ascontiguousarray(x.numpy()))
        elif self.channels_last:
            # NHWC bytes are the channels_last layout already: convert in place, no transpose.
            out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            out.copy_(x).mul_(scale).add_(shift)
            out = out.permute(0, 3, 1, 2)
        else:
            out = torch.empty((x.shape[0], 3, x.shape[1], x.shape[2]), dtype=torch.float32, device=x.device)
            out.copy_(x.permute(0, 3, 1, 2)).mul_(scale.view(1, 3, 1, 1)).add_(shift.view(1, 3, 1, 1))
        return out if self.dtype == torch.float32 else out.to(self.dtype)  # .to keeps the memory format

    def _on_cpu(self, a: np.ndarray) -> torch.Tensor:
        """(B, H, W, 3) uint8 -> float32 (B, 3, H, W) in the asked layout, with NumPy, each image written
        straight into the new batch as the workers write theirs (``WorkerNormalize``), the images split over
        threads (as many as ``torch.get_num_threads()``; NumPy releases the GIL): a CPU device's batches are
        normalised on every core the process may use, not in one thread while the workers wait
        (BENCHMARKS.md#cpu-only-machines)."""
        b, h, w, _ = a.shape
        out = _float_batch(a.shape if self.channels_last else (b, 3, h, w))
        each = self.for_workers()

        def images(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                each.into(a[i], out[i])

        _in_parallel(images, b)
        tensor = torch.from_numpy(out)
        return tensor.permute(0, 3, 1, 2) if self.channels_last else tensor

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        return self.images(images), labels

    def for_workers(self) -> "WorkerNormalize":
        """This normalisation as CPU-device workers apply it to each image they finish (float32, the
        layout asked for); ``finished`` then turns their batch into the user's."""
        scale, shift = normalize_constants(self.mean, self.std)
        return WorkerNormalize(tuple(scale), tuple(shift), self.channels_last)

    def finished(self, x: torch.Tensor) -> torch.Tensor:
        """A batch the workers normalised, (B, S, S, 3) (channels_last) or (B, 3, S, S) float32 viewing the
        shared ring -> (B, 3, S, S) ``dtype`` of the caller's own, in the asked layout: a copy (float32: into
        a reused array, split over threads; else the cast), so the ring slot can be reused at once."""
        if x.dtype != torch.float32 or x.dim() != 4:
            raise ValueError(f"expected a (B, S, S, 3) or (B, 3, S, S) float32 batch, got {tuple(x.shape)} {x.dtype}")
        if self.dtype != torch.float32:
            out = x.to(self.dtype)
        else:
            src = x.numpy()
            dst = _float_batch(src.shape)
            _in_parallel(lambda lo, hi: np.copyto(dst[lo:hi], src[lo:hi]), len(src))
            out = torch.from_numpy(dst)
        return out.permute(0, 3, 1, 2) if self.channels_last else out


def _new_float_batch(shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    return lambda: np.empty(math.prod(shape), np.float32)


def _refs(arrays: list, k: int) -> int:
    return sys.getrefcount(arrays[k])


# what ``_refs`` counts for an array only a list refers to, on this Python (3.14 counts borrowed references
# differently from 3.10-3.13)
_REFS_IN_A_LIST = _refs([np.empty(0)], 0)
# float32 batch arrays handed out again once nothing refers to them: a new array of a batch's size is mapped
# fresh by the kernel, one page fault per 4 KB (154 MB at batch 256), which bounds a CPU device's rate
# (BENCHMARKS.md#cpu-only-machines). A tensor made with ``torch.from_numpy`` (and every view of it) keeps its
# array referenced. Arrays are kept flat and handed out as their head in the asked shape, so a smaller image
# size (progressive resizing) reuses the larger size's arrays.
_batches = ReusePool(keep=8, is_free=lambda arrays, k: _refs(arrays, k) == _REFS_IN_A_LIST)


def _float_batch(shape: tuple[int, ...]) -> np.ndarray:
    """A C-contiguous float32 array of ``shape`` that nothing outside the pool refers to."""
    n = math.prod(shape)
    return _batches.take(lambda a: a.size >= n, _new_float_batch(shape))[:n].reshape(shape)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _in_parallel(fn, n: int) -> None:
    """``fn(lo, hi)`` over [0, n) split among ``torch.get_num_threads()`` threads (this thread takes a part)."""
    global _pool
    parts = max(1, min(n, torch.get_num_threads()))
    bounds = [n * k // parts for k in range(parts + 1)]
    if parts == 1:
        fn(0, n)
        return
    with _pool_lock:
        if _pool is None or _pool._max_workers < parts - 1:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(parts - 1, thread_name_prefix="gpufeed-normalize")
        futures = [_pool.submit(fn, bounds[k], bounds[k + 1]) for k in range(1, parts)]
    fn(bounds[0], bounds[1])
    for f in futures:
        f.result()
