"""The GPU memory a loader holds: its budget, sized once when it is made."""

from __future__ import annotations

from typing import NamedTuple

# Decoded pixels per image each GPU decode buffer is sized for: ImageNet's training JPEGs average about
# 400 x 350 (most are 500 x 375 or smaller); a batch of larger images goes through in slices, never a bigger buffer.
BUFFER_PIXELS_PER_IMAGE = 512 * 512


class GpuMemory(NamedTuple):
    """The loader's GPU memory: two decode buffers of ``buffer_bytes`` (GPU decode only; allocated at
    construction) and ``batches`` output batches of ``batch_bytes`` in flight; ``total``, all of it."""

    buffer_bytes: int
    batch_bytes: int
    batches: int

    @property
    def total(self) -> int:
        return 2 * self.buffer_bytes + self.batches * self.batch_bytes


def gpu_memory(*, batch_size: int, image_size: int, itemsize: int, prefetch_depth: int, gpu_decode: bool,
               max_gpu_memory: int | None = None) -> GpuMemory:
    """The GPU budget: output batches of (B, 3, S, S) x ``itemsize`` bytes, as many as can be in flight
    (``prefetch_depth`` queued, one being made, the consumer's, the one it just let go); with GPU decode two
    buffers of B x 3 x ``BUFFER_PIXELS_PER_IMAGE`` bytes each, or, under ``max_gpu_memory``, what it leaves
    for them. Nothing the loader allocates on the GPU grows past it."""
    batch = batch_size * 3 * image_size * image_size * itemsize
    batches = prefetch_depth + 3
    if not gpu_decode:
        buffer = 0
        if max_gpu_memory is not None and max_gpu_memory < batches * batch:
            raise ValueError(f"max_gpu_memory={max_gpu_memory} is less than the {batches} output batches in flight "
                             f"need ({batches * batch} bytes); lower batch_size or prefetch_depth")
    elif max_gpu_memory is None:
        buffer = batch_size * 3 * max(image_size * image_size, BUFFER_PIXELS_PER_IMAGE)
    else:
        buffer = (max_gpu_memory - batches * batch) // 2
        least = image_size * image_size * 3
        if buffer < least:
            raise ValueError(f"max_gpu_memory={max_gpu_memory} leaves no room to decode: {batches} output batches take "
                             f"{batches * batch} bytes and each decode buffer needs at least {least}; allow at "
                             f"least {batches * batch + 2 * least} or lower batch_size or prefetch_depth")
    return GpuMemory(buffer, batch, batches)


def ring_slots(prefetch_depth: int, gpu_decode: bool) -> int:
    """Batch slots in the shared-memory ring: the batches in flight on the device (``prefetch_depth``), one
    being made by the workers and one handed over (at least four, so the workers never wait for a slot), and
    one more with GPU decode, whose stage holds a batch until the next one is started."""
    return max(4, prefetch_depth + 2) + gpu_decode
