"""The GPU stage: decode a batch on the GPU and crop/resize/flip/normalise it in one kernel.

Input is an ``EncodedBatch`` that CPU workers filled: per sample either the
JPEG bytes and crop box (``kind == KIND_BYTES``) or pixels they already
cropped because no GPU decoder takes that file (``KIND_PIXELS``). It runs as
the Prefetcher's transform, on its side stream, in its background thread; the
consumer's stream waits on the event recorded after the kernel.

    bytes ──GPU decoders (threads, GIL released)──► (h, w, 3) uint8 ─┐
    refused by the GPU ──CPU decode + crop (here)──► (S, S, 3) ───────┼─► pack ─► fused kernel ─► (B, 3, S, S)
    odd files, cropped by the workers ────────────► (S, S, 3) ───────┘

A pre-cropped image enters the kernel as an S x S image with box (0, 0, S, S),
which the kernel copies exactly while normalising. Batches whose images
together exceed ``max_batch_pixels`` go through in consecutive slices, so
decode memory stays bounded.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .augment.cpu import crop_resize_into
from .augment.fused import normalize_constants, pack_images, resized_crop_reference, resized_crop_triton, triton
from .augment.params import CropBox
from .decode.base import DecodeError
from .decode.cpu import CpuDecoder
from .ring import KIND_BYTES

DEFAULT_MAX_BATCH_PIXELS = 256 * 1024 * 1024


@dataclass
class EncodedBatch:
    """One batch before GPU decode (host side; only ``labels`` is moved by the Prefetcher).

    labels (B,) int64; meta (B, 9) int64 (``workers.META_FIELDS``); arena (B, capacity)
    uint8 with sample i's bytes in ``arena[i, :meta[i, 1]]``; pixels (B, S, S, 3) uint8 for
    ``KIND_PIXELS`` rows; ``path(i)`` names sample i's file for error messages.
    """

    labels: torch.Tensor
    meta: np.ndarray
    arena: np.ndarray
    pixels: np.ndarray
    path: Callable[[int], str]


def _slices(sizes: Sequence[tuple[int, int]], budget: int) -> list[range]:
    out, start, acc = [], 0, 0
    for i, (w, h) in enumerate(sizes):
        if i > start and acc + w * h > budget:
            out.append(range(start, i))
            start, acc = i, 0
        acc += w * h
    out.append(range(start, len(sizes)))
    return out


class GpuDecodeAugment:
    """EncodedBatch -> ((B, 3, S, S) ``dtype`` normalised on ``device``, (B,) int64 labels)."""

    def __init__(self, decoders: Sequence, *, device: torch.device, image_size: int, mean, std,
                 dtype: torch.dtype, channels_last: bool, max_pixels: int,
                 max_batch_pixels: int = DEFAULT_MAX_BATCH_PIXELS,
                 on_skip: Callable[[str, str], None] | None = None) -> None:
        self.decoders = list(decoders)
        self.name = self.decoders[0].name
        self._threads = ThreadPoolExecutor(len(self.decoders), thread_name_prefix="gpufeed-decode")
        self.cpu = CpuDecoder(max_pixels=max_pixels)
        self.device, self.size, self.dtype, self.channels_last = device, image_size, dtype, channels_last
        self.scale, self.shift = normalize_constants(mean, std)
        self._scale_t = torch.tensor(self.scale)
        self._shift_t = torch.tensor(self.shift)
        self.max_batch_pixels = max_batch_pixels
        self.on_skip = on_skip  # None: a file no decoder reads raises DecodeError; else it is dropped and reported
        self.decoded_by: collections.Counter = collections.Counter()  # "gpu:<name>", "cpu" -> images

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        n, s = len(batch.meta), self.size
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        out = torch.empty((n, 3, s, s), dtype=self.dtype, device=self.device, memory_format=fmt)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        meta = batch.meta
        sizes = [(int(w), int(h)) if k == KIND_BYTES else (s, s) for k, w, h in meta[:, [0, 2, 3]]]
        dropped: list[int] = []
        for r in _slices(sizes, self.max_batch_pixels):
            images, rows = self._decode(batch, r, stream, dropped)
            flat, offsets = pack_images(images)
            table = torch.tensor(rows, dtype=torch.int64)
            table[:, 0] = torch.tensor(offsets, dtype=torch.int64)
            dst = out[r.start : r.stop]
            if triton is not None and self.device.type == "cuda":
                resized_crop_triton(flat, self._upload(table), s, self.scale, self.shift, dst)
            else:
                resized_crop_reference(flat, table.to(self.device), s, self._scale_t.to(self.device),
                                       self._shift_t.to(self.device), dst)
        if dropped:
            keep = torch.tensor([i for i in range(n) if i not in set(dropped)], device=self.device)
            return out.index_select(0, keep), batch.labels.index_select(0, keep)
        return out, batch.labels

    def _decode(self, batch: EncodedBatch, r: range, stream, dropped: list[int]):
        """Images for samples ``r`` (on the device) and their kernel rows (offset filled later).
        Samples that no decoder reads are appended to ``dropped`` (skip policy) and get a 1x1 stand-in."""
        meta, s = batch.meta, self.size
        gpu_ids = [i for i in r if meta[i, 0] == KIND_BYTES]
        decoded = dict(zip(gpu_ids, self._decode_gpu([batch.arena[i, : meta[i, 1]].tobytes() for i in gpu_ids],
                                                     stream)))
        images, rows, pixel_rows = {}, {}, []
        for i in r:
            kind, _, fw, fh, x, y, bw, bh, flip = (int(v) for v in meta[i])
            img = decoded.get(i)
            if img is not None:
                h, w = img.shape[0], img.shape[1]
                sx, sy = w / fw, h / fh  # 1 unless a decoder returned another size
                images[i] = img
                rows[i] = [0, h, w, round(x * sx), round(y * sy), max(1, round(bw * sx)), max(1, round(bh * sy)),
                           flip]
                continue
            if kind == KIND_BYTES:  # the GPU refused it: decode and crop here, into the slot's pixel row
                data = batch.arena[i, : meta[i, 1]].tobytes()
                path = batch.path(i)
                try:
                    _, _, fast = self.cpu.header(data, path)
                    pixels = self.cpu.decode(data, path, fast=fast)
                except DecodeError as e:
                    if self.on_skip is None:
                        raise
                    self.on_skip(path, e.reason)
                    dropped.append(i)
                    images[i] = torch.zeros((1, 1, 3), dtype=torch.uint8, device=self.device)
                    rows[i] = [0, 1, 1, 0, 0, 1, 1, 0]
                    continue
                crop_resize_into(pixels, CropBox(x, y, bw, bh, bool(flip)), (fw, fh), batch.pixels[i])
            pixel_rows.append(i)
            rows[i] = [0, s, s, 0, 0, s, s, 0]
        if pixel_rows:
            dev = self._upload(torch.from_numpy(batch.pixels[pixel_rows]))  # fancy indexing: one copy for all
            for j, i in enumerate(pixel_rows):
                images[i] = dev[j]
            self.decoded_by["cpu"] += len(pixel_rows)
        self.decoded_by[f"gpu:{self.name}"] += len(decoded) - sum(v is None for v in decoded.values())
        return [images[i] for i in r], [rows[i] for i in r]

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _decode_gpu(self, datas: list[bytes], stream) -> list[torch.Tensor | None]:
        if not datas:
            return []
        parts = len(self.decoders)
        step = -(-len(datas) // parts)
        chunks = [datas[i : i + step] for i in range(0, len(datas), step)]
        if len(chunks) == 1:
            return self.decoders[0].decode(chunks[0], stream)
        futures = [self._threads.submit(dec.decode, chunk, stream) for dec, chunk in zip(self.decoders, chunks)]
        return [img for f in futures for img in f.result()]
