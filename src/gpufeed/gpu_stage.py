"""The GPU stage: decode a batch on the GPU and crop/resize/flip/normalise it in one kernel.

Runs as the Prefetcher's transform, on its side stream, in its background
thread: the consumer's stream waits on the event recorded after the kernel.
Images a GPU decoder refuses are decoded by the CPU decoder and uploaded, in
the same batch. Batches whose images together exceed ``max_batch_pixels`` are
processed in consecutive slices so decode memory stays bounded.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np
import torch

from .augment.fused import normalize_constants, pack_images, resized_crop_reference, resized_crop_triton, triton
from .decode.cpu import CpuDecoder
from .reader import EncodedBatch

DEFAULT_MAX_BATCH_PIXELS = 256 * 1024 * 1024


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

    def __init__(self, decoder, *, device: torch.device, image_size: int, mean, std, dtype: torch.dtype,
                 channels_last: bool, max_pixels: int, max_batch_pixels: int = DEFAULT_MAX_BATCH_PIXELS) -> None:
        self.decoder = decoder
        self.cpu = CpuDecoder(max_pixels=max_pixels)
        self.device, self.size, self.dtype, self.channels_last = device, image_size, dtype, channels_last
        self.scale, self.shift = normalize_constants(mean, std)
        self.max_batch_pixels = max_batch_pixels
        self.decoded_by: collections.Counter = collections.Counter()  # backend name -> images

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        n, s = len(batch.data), self.size
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        out = torch.empty((n, 3, s, s), dtype=self.dtype, device=self.device, memory_format=fmt)
        stream = torch.cuda.current_stream(self.device)
        for r in _slices(batch.sizes, self.max_batch_pixels):
            images = self._decode(batch, r, stream)
            flat, offsets = pack_images(images)
            rows = []
            for off, img, i in zip(offsets, images, r):
                h, w = img.shape[0], img.shape[1]
                box = batch.boxes[i]
                fw, fh = batch.sizes[i]
                sx, sy = w / fw, h / fh  # 1 unless a decoder returned another size
                rows.append([off, h, w, round(box.x * sx), round(box.y * sy), max(1, round(box.width * sx)),
                             max(1, round(box.height * sy)), int(box.flip)])
            meta = torch.tensor(rows, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
            dst = out[r.start : r.stop]
            if triton is not None:
                resized_crop_triton(flat, meta, s, self.scale, self.shift, dst)
            else:
                resized_crop_reference(flat, meta, s, torch.tensor(self.scale, device=self.device),
                                       torch.tensor(self.shift, device=self.device), dst)
        return out, batch.labels

    def _decode(self, batch: EncodedBatch, r: range, stream: torch.cuda.Stream) -> list[torch.Tensor]:
        gpu_ids = [i for i in r if batch.data[i] is not None]
        images: dict[int, torch.Tensor] = {}
        if gpu_ids:
            for i, img in zip(gpu_ids, self.decoder.decode([batch.data[i] for i in gpu_ids], stream)):
                if img is not None:
                    images[i] = img
            self.decoded_by[self.decoder.name] += len(images)
        for i in r:
            if i in images:
                continue
            pixels = batch.pixels[i]
            if pixels is None:  # the GPU decoder refused a JPEG: the CPU decides (and names the file if bad)
                data = batch.data[i]
                _, _, fast = self.cpu.header(data, batch.paths[i])
                pixels = self.cpu.decode(data, batch.paths[i], fast=fast)
            images[i] = torch.from_numpy(np.ascontiguousarray(pixels)).pin_memory().to(self.device, non_blocking=True)
            self.decoded_by["cpu"] += 1
        return [images[i] for i in r]
