"""The GPU memory a loader holds: its budget, sized once when it is made."""

from __future__ import annotations

from typing import NamedTuple

# Decoded pixels per image each GPU decode buffer is sized for: ImageNet's training JPEGs average about
# 400 x 350 (most are 500 x 375 or smaller); a batch of larger images goes through in slices, never a bigger buffer.
BUFFER_PIXELS_PER_IMAGE = 512 * 512

# The side of the images nvJPEG's engine decoders take room for when made: a quarter of the memory room for
# 1024 x 1024 takes, and a larger image (up to ``GPU_MAX_SIDE``) grows a decoder only to what it needs
# (BENCHMARKS.md#memory).
ENGINE_ROOM_SIDE = 512


# PyTorch's caching allocator (its default configuration) reserves whole segments: blocks of up to 1 MiB share
# 2 MiB segments, one set per stream; blocks under 10 MiB share 20 MiB segments; larger ones get a segment of
# their own rounded up to 2 MiB. The budget counts those segments, which is what the GPU gives up.
_MIB = 1 << 20
SMALL_SEGMENT, MID_SEGMENT, LARGE_FROM, LARGE_ROUND = 2 * _MIB, 20 * _MIB, 10 * _MIB, 2 * _MIB


def reserved_bytes(size: int, n: int) -> int:
    """The segments the caching allocator reserves for ``n`` blocks of ``size`` bytes allocated together."""
    size = -(-size // 512) * 512
    if n == 0 or size == 0:
        return 0
    if size >= LARGE_FROM:
        return n * -(-size // LARGE_ROUND) * LARGE_ROUND
    segment = SMALL_SEGMENT if size <= _MIB else MID_SEGMENT
    return -(-n // (segment // size)) * segment


def _largest_pair(space: int) -> int:
    """The largest ``size`` whose two blocks fit in ``space`` bytes of segments (0 if none does)."""
    large = space // 2 // LARGE_ROUND * LARGE_ROUND
    if large >= LARGE_FROM:
        return large
    if space >= MID_SEGMENT:
        return LARGE_FROM - 512
    return _MIB if space >= SMALL_SEGMENT else 0


class GpuMemory(NamedTuple):
    """The loader's GPU memory: two decode buffers of ``buffer_bytes`` (GPU decode only; allocated at
    construction), ``batches`` output batches of ``batch_bytes`` in flight, and the small tensors (labels,
    per-batch parameters) of ``streams`` CUDA streams; ``total``, the allocator's segments for all of it."""

    buffer_bytes: int
    batch_bytes: int
    batches: int
    streams: int

    @property
    def total(self) -> int:
        return (reserved_bytes(self.buffer_bytes, 2) + reserved_bytes(self.batch_bytes, self.batches)
                + self.streams * SMALL_SEGMENT)


def gpu_memory(*, batch_size: int, image_size: int, itemsize: int, prefetch_depth: int, gpu_decoders: int,
               max_gpu_memory: int | None = None) -> GpuMemory:
    """The GPU budget: output batches of (B, 3, S, S) x ``itemsize`` bytes, as many as can be in flight
    (``prefetch_depth`` queued, one being made, the consumer's, the one it just let go); with GPU decode
    (``gpu_decoders`` > 0) two buffers of B x 3 x ``BUFFER_PIXELS_PER_IMAGE`` bytes each, or, under
    ``max_gpu_memory``, what it leaves for them; small tensors on each decoder's stream, the copies' stream and
    the stream the batches are made on. Counted as the allocator's segments (``reserved_bytes``); nothing the
    loader allocates on the GPU grows past it."""
    batch = batch_size * 3 * image_size * image_size * itemsize
    batches, streams = prefetch_depth + 3, gpu_decoders + 2
    outputs = reserved_bytes(batch, batches) + streams * SMALL_SEGMENT
    if not gpu_decoders:
        buffer = 0
        if max_gpu_memory is not None and max_gpu_memory < outputs:
            raise ValueError(f"max_gpu_memory={max_gpu_memory} is less than the {batches} output batches in flight "
                             f"need ({outputs} bytes of the allocator's segments); lower batch_size or "
                             f"prefetch_depth")
    elif max_gpu_memory is None:
        buffer = batch_size * 3 * max(image_size * image_size, BUFFER_PIXELS_PER_IMAGE)
    else:
        buffer = _largest_pair(max_gpu_memory - outputs)
        least = image_size * image_size * 3
        if buffer < least:
            raise ValueError(f"max_gpu_memory={max_gpu_memory} leaves no room to decode: {batches} output batches "
                             f"and the streams' small tensors take {outputs} bytes of the allocator's segments "
                             f"and each decode buffer needs at least {least}; allow at least "
                             f"{outputs + reserved_bytes(least, 2)} or lower batch_size or prefetch_depth")
    return GpuMemory(buffer, batch, batches, streams)


def ring_slots(prefetch_depth: int, gpu_decode: bool) -> int:
    """Batch slots in the shared-memory ring: the batches in flight on the device (``prefetch_depth``), one
    being made by the workers and one handed over (at least four, so the workers never wait for a slot), and
    one more with GPU decode, whose stage holds a batch until the next one is started."""
    return max(4, prefetch_depth + 2) + gpu_decode
