"""The device-side stage on the GPU path: decode a batch on the GPU and crop/resize/flip/normalise it in one
kernel (``GpuDecodeAugment``), then the recipe's per-sample ops (``GpuStage``). Training's crops go through
``augment.fused``; validation's Resize + CenterCrop through ``augment.center_crop`` (``crop="center"``).

Input is a ``records.HostBatch`` whose ring slot the CPU workers filled, per sample (``ring.Meta``): the
JPEG bytes and crop box (``KIND_BYTES``), or the rows of the crop they decoded and the box within them
(``KIND_ROWS``: the CPU's share of the batch, resized here with the rest), or pixels they already cropped
and resized (``KIND_PIXELS``: files no GPU decoder takes, and shares whose rows did not fit). It runs as
the Prefetcher's transform, on its side stream, in its background thread, in two steps: ``start`` lays
batch k+1 out and hands its JPEGs to the decoder threads, then ``finish`` completes batch k (CPU
fallbacks, kernel); the consumer's stream waits on the event recorded after the kernel. Two decode buffers
are used in turn, so batch k+1 decodes while batch k's kernel is still to run.

    a flat uint8 buffer on the device, in batch order, laid out from the workers' headers:
    [ image 0 (h0, w0, 3) | CPU rows of 1 | pre-cropped 2 (S, S, 3) | image 3 ... ]
          ▲ GPU decoders write here directly (threads, own streams)
                            ▲ one H2D copy each, from the ring's page-locked pixel rooms
          ▲ a file the GPU refuses: CPU decode + crop here, copied in
    ──► one fused crop/resize/flip/normalise kernel ──► (B, 3, S, S) (uint8, not normalised, for a
                                                        recipe's pixel ops: ``GpuDecodeAugment``)

Streams: each decoder thread has its own stream, which first waits for the work queued so far on the side
stream (the buffer's last reader, this batch's copies), on the host too where the decoder writes outside the
stream's order (nvJPEG's engines: ``base.engines_after``); ``finish`` makes the side stream wait for every
decode call's event before the kernel. The host arrays (the ring slot) are read until the decoders'
calls returned and the copies ran: ``finish`` calls ``batch.release()`` once the last of those is queued,
which records the slot's event on the side stream. That is before the kernel, whose output batch may first
wait for the training's queued work (a reused output batch): the workers get the slot back as soon as the
GPU has read it, not once the training has caught up.

A pre-cropped image enters the kernel as an S x S image with box (0, 0, S, S), which the kernel copies
exactly while normalising.

Memory: the two decode buffers (``buffer_bytes`` each) are allocated at construction and never grow; a
batch whose images need more goes through in consecutive slices, and no image larger than a buffer comes
here (``placement.gpu_may_take``). Output batches are reused once nothing but the stage refers to them
(``buffers.ReusePool``), so their number stays what the prefetch depth keeps in flight. That is the loader's whole
GPU budget (``placement.gpu_memory``); nvJPEG's decoders take their own memory when made and grow it only
for an image larger than their room (``placement.ENGINE_ROOM_SIDE``), and a recipe's per-sample ops make
their batches from PyTorch's caching allocator.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from ..augment.fused import normalize_constants
from ..buffers import ReusePool
from ..decode.base import DecodeError, DecodeJob, GpuDecoder, SkipLog
from ..decode.cpu import CpuDecoder
from ..records import BOX, KIND_BYTES, KIND_PIXELS, KIND_ROWS, Delivered, KernelRow, Meta
from .decoding import CudaDecoding, HostDecoding
from .refused import CROPS, decode_refused, settle_dropped

if TYPE_CHECKING:
    from ..records import HostBatch


def _slices(sizes: Sequence[int], budget: int) -> list[range]:
    """Consecutive ranges of samples whose sizes together stay within ``budget`` (at least one each)."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and acc + n > budget:
            out.append(range(start, i))
            start, acc = i, 0
        acc += n
    out.append(range(start, len(sizes)))
    return out


class GpuDecodeAugment:
    """HostBatch (GPU path) -> ((B, 3, S, S) ``dtype`` normalised on ``device``, (B,) int64 labels). ``dtype``
    torch.uint8: the crops' pixels, each the nearest level, contiguous and not normalised (``mean``, ``std``
    and ``channels_last`` unused): a recipe's pixel ops start from them (``SampleOps.from_pixels``).

    S: the size the batch was made at (``batch.slot.size``), at most ``image_size``, the size output batches
    are allocated for (a smaller one uses the head of one: progressive resizing allocates nothing).

    ``decoders``: one or more ``GpuDecoder``; with several, each decodes a part of every batch from its
    own thread on its own CUDA stream. ``buffer_bytes``: each of the two decode buffers (allocated now).
    ``skips``: None, a file no decoder reads raises ``DecodeError``; else it is recorded there and another
    image of the batch stands in for it, or for ``crop="center"`` it leaves the batch (``refused``).
    ``crop``: "box", the workers' crop box and flip (training's RandomResizedCrop, ``augment.fused``);
    "center", validation's Resize + CenterCrop in Pillow's arithmetic (``augment.center_crop``), the meta
    rows holding each sample's resized extent and crop corner. ``output_batches``: (batch size, how many) output
    batches to allocate now (``placement.gpu_memory``); more are made only while the user keeps batches.
    ``cpu``: the decoder of what no GPU decoder read (``refused``; None: a ``CpuDecoder`` of ``max_pixels``).
    """

    def __init__(self, decoders: Sequence[GpuDecoder], *, device: torch.device, image_size: int, mean, std,
                 dtype: torch.dtype, channels_last: bool, max_pixels: int, buffer_bytes: int,
                 skips: SkipLog | None = None, output_batches: tuple[int, int] = (0, 0), crop: str = "box",
                 cpu: CpuDecoder | None = None) -> None:
        if crop not in CROPS:
            raise ValueError(f"crop must be one of {CROPS}, got {crop!r}")
        self.decoders, self.crop = list(decoders), crop
        self.name = self.decoders[0].name
        self.job_images = self.decoders[0].job_images
        self.cpu = cpu if cpu is not None else CpuDecoder(max_pixels=max_pixels)
        pixels = dtype == torch.uint8
        self.device, self.size, self.dtype, self.channels_last = device, image_size, dtype, channels_last and not pixels
        self.scale, self.shift = ([1.0] * 3, [0.0] * 3) if pixels else normalize_constants(mean, std)
        if buffer_bytes < image_size * image_size * 3:
            raise ValueError(f"buffer_bytes must hold one {image_size} x {image_size} x 3 image, got {buffer_bytes}")
        self.buffer_bytes = buffer_bytes
        self.skips = skips
        self._consumer: torch.cuda.Stream | None = None  # ``read_on``
        self.decoded_by: collections.Counter = collections.Counter()  # "gpu:<name>", "cpu" -> images
        self._device = (CudaDecoding if device.type == "cuda" else HostDecoding)(self.decoders, device, self.scale,
                                                                                   self.shift, crop)
        self._flats = [torch.empty(buffer_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self._turn = 0
        # made at the first batch, on the stream the stage runs on (their memory returns to that stream's pool)
        self._planned_outputs = output_batches
        # output batches handed out again once nothing refers to them (as a view of the head: a short last
        # batch, a smaller image size); without reuse the caching allocator takes a new block whenever the
        # training's work on an old batch has not finished when the next is made (BENCHMARKS.md#memory)
        self._outputs = ReusePool(keep=max(8, output_batches[1]), is_free=lambda items, k: _only_the_pool(items[k]))

    def __call__(self, batch: "HostBatch") -> tuple[torch.Tensor, torch.Tensor]:
        return self.finish(self.start(batch))

    @property
    def held_outputs(self) -> tuple[torch.Tensor, ...]:
        """The output batches the stage holds, flat, oldest first (what it takes of the GPU budget beside the
        decode buffers, while the user keeps no batch)."""
        return self._outputs.held

    def read_on(self, stream: "torch.cuda.Stream | None") -> None:
        """The stream the batches are read on from now (the training's, as an iteration starts): a reused
        output batch first waits for the work queued there."""
        self._consumer = stream

    def start(self, batch: "HostBatch") -> "_Started":
        """Lay the batch out in a decode buffer, queue its CPU-filled pixels' copies and hand its JPEGs to
        the decoder threads; returns at once (on CUDA). ``finish`` completes it: the Prefetcher starts
        batch k+1 before it finishes batch k, so the decoders always have the next batch queued. A batch
        over ``buffer_bytes`` goes through in slices here, synchronously."""
        s, meta = batch.slot.size, batch.slot.meta
        kind = meta[:, Meta.KIND]
        encoded = kind == KIND_BYTES
        # decoded extents: the header's for encoded samples and the rows' for CPU-decoded rows; S x S pre-cropped
        sized = kind != KIND_PIXELS
        heights = np.where(sized, meta[:, Meta.HEIGHT], s)
        widths = np.where(sized, meta[:, Meta.WIDTH], s)
        # what the CPU filled, in each sample's pixel room: pre-cropped S x S x 3, or the crop's decoded rows;
        # each sample's place in the buffer: encoded images get at least S x S x 3 bytes, so a GPU refusal
        # cropped on the CPU fits in its place
        px = s * s * 3
        filled = np.where(kind == KIND_ROWS, meta[:, Meta.LENGTH], px)
        room = np.where(encoded, np.maximum(heights * widths * 3, px), filled)
        if len(room) and room.max() > self.buffer_bytes:  # the workers keep such images (placement.gpu_may_take)
            i = int(room.argmax())
            raise ValueError(f"{batch.path(i)!r} needs {int(room[i])} bytes decoded, over the GPU decode buffer's "
                             f"{self.buffer_bytes}")
        started = _Started(batch)
        parts = _slices(room.tolist(), self.buffer_bytes)
        try:
            for k, r in enumerate(parts):
                if k:  # the previous slice is finished (kernel queued) before its buffer is reused
                    self._complete(started)
                sl = slice(r.start, r.stop)
                started.part = self._prepare(batch, r, encoded[sl], heights[sl], widths[sl], filled[sl], room[sl],
                                             turn=k == 0)
                started.decoding = self._submit_decode(batch, started.part)
        except BaseException:  # no finish will come: let the decoders stop reading, then hand the batch back
            if started.decoding:
                wait(started.decoding)
            started.release()
            raise
        return started

    def finish(self, started: "_Started") -> tuple[torch.Tensor, torch.Tensor]:
        """((B, 3, S, S) ``dtype`` on the device, (B,) labels) for a started batch. Calls ``batch.release()``
        once nothing reads its host memory any more (later GPU work is ordered on the current stream). A
        file no decoder read (under ``skips``) has another image of the batch in its place, or for
        ``crop="center"`` is left out (B is then smaller), and ``batch.indices`` says so."""
        try:
            self._complete(started, last=True)
        finally:
            if started.decoding is not None:  # failed before the decode was awaited: no thread may still read
                wait(started.decoding)
            started.release()
        out, labels = started.out, started.batch.labels
        if started.dropped:
            out, labels = settle_dropped(out, labels, started.batch, started.dropped, self.crop, self.skips)
        return out, labels

    def _complete(self, started: "_Started", last: bool = False) -> None:
        """Await the current slice's decode, finish what the GPU refused on the CPU, run the kernel. ``last``:
        the batch's last slice, after whose copies nothing reads the slot: it is released before the kernel."""
        batch, part = started.batch, started.part
        ok = self._await_decode(started.decoding)
        started.decoding = None
        for j in (int(j) for j, good in zip(part.enc, ok) if not good):
            self._finish_on_cpu(batch, part.r.start + j, part.table[j], part.flat, started.dropped)
        if last:
            started.release()
        if started.out is None:
            started.out = self._output(len(batch.slot.meta), batch.slot.size)
        self._device.kernel(part.flat, torch.from_numpy(part.table), batch.slot.size,
                            started.out[part.r.start : part.r.stop])

    def _output(self, n: int, s: int) -> torch.Tensor:
        """An (n, 3, s, s) ``dtype`` batch on the device in the asked memory format, laid out as a new one
        would be: the head of an output batch nothing else refers to, or of a new one. Output batches are
        made for ``n`` images of the stage's ``image_size``, the largest, so a smaller size reuses them."""
        planned, count = self._planned_outputs
        if count:
            self._planned_outputs = (0, 0)
            for _ in range(count):
                self._outputs.add(self._new_output(planned))
        numel = n * 3 * s * s
        flat = self._outputs.take(lambda t: t.numel() >= numel)
        if flat is None:
            flat = self._outputs.add(self._new_output(n))
        else:
            self._after_consumer()
        if self.channels_last:
            return flat[:numel].view(n, s, s, 3).permute(0, 3, 1, 2)
        return flat[:numel].view(n, 3, s, s)

    def _new_output(self, n: int) -> torch.Tensor:
        """Room for n images of the largest size, flat."""
        return torch.empty(n * 3 * self.size * self.size, dtype=self.dtype, device=self.device)

    def _after_consumer(self) -> None:
        """Order the current (side) stream after the work queued so far on the consumer's stream: a reused
        output batch, which nothing refers to any more, had all its readers queued there. Not for uint8
        outputs: the pixel ops read them on this stream, and the consumer gets their own batch."""
        if self._consumer is not None and self.device.type == "cuda" and self.dtype != torch.uint8:
            side = torch.cuda.current_stream(self.device)
            if self._consumer != side:
                side.wait_stream(self._consumer)

    def _prepare(self, batch: "HostBatch", r: range, encoded: np.ndarray, h: np.ndarray, w: np.ndarray,
                 filled: np.ndarray, room: np.ndarray, turn: bool) -> "_Part":
        """Samples ``r`` of ``batch`` laid out in a decode buffer in batch order (local row j is sample
        r.start + j, ``room[j]`` bytes), the kernel's table, and the copies of what the CPU filled (``filled``
        bytes: pre-cropped pixels, decoded rows) queued. ``turn``: take the other buffer than last time (the
        previous batch's kernel may not have run yet)."""
        s = batch.slot.size
        local = np.arange(len(r))
        meta = batch.slot.meta[r.start : r.stop]
        host, enc = local[~encoded], local[encoded]
        pre = local[meta[:, Meta.KIND] == KIND_PIXELS]
        offset = np.concatenate([[0], np.cumsum(room)[:-1]])
        flat = self._buffer(int(room.sum()), turn)
        table = np.empty((len(r), len(KernelRow)), np.int64)  # the kernel's row per sample
        table[:, KernelRow.OFFSET], table[:, KernelRow.HEIGHT], table[:, KernelRow.WIDTH] = offset, h, w
        table[:, KernelRow.BOX_X:] = meta[:, BOX]
        table[pre, KernelRow.HEIGHT:] = (s, s, 0, 0, s, s, 0)  # pre-cropped: the whole S x S image, copied
        if len(host) and not self._device.copy_rooms(batch.slot, r.start + host, filled[host], flat, offset[host]):
            room_of = self._rooms(batch)  # one copy each (a sample's room is larger than what it holds)
            for j in host.tolist():
                n = int(filled[j])
                flat[offset[j] : offset[j] + n].copy_(room_of(r.start + j, n), non_blocking=True)
        self.decoded_by["cpu"] += len(host)
        return _Part(r, enc, flat, offset[enc], h[enc], w[enc], table)

    def _rooms(self, batch: "HostBatch") -> Callable[[int, int], torch.Tensor]:
        """(i, n) -> the first n bytes of sample i's pixel room as a host tensor for an H2D copy (the
        page-locked check is made once per batch). Without rooms, sample i's pixels."""
        slot = batch.slot
        if slot.rooms is None:  # pre-cropped pixels only
            return lambda i, n: self._device.host(slot.images[i]).view(-1)[:n]
        rooms = torch.from_numpy(slot.rooms)
        if self._device.pinned(rooms):
            return lambda i, n: rooms[i, :n]
        return lambda i, n: rooms[i, :n].pin_memory()

    def _finish_on_cpu(self, batch: "HostBatch", i: int, row: np.ndarray, flat: torch.Tensor,
                       dropped: list[int]) -> None:
        """Sample ``i`` that the GPU refused: decode, crop and resize it here, into its place in ``flat``."""
        s = batch.slot.size
        try:
            decode_refused(self.cpu, batch, i, self.crop)
        except DecodeError as e:
            if self.skips is None:
                raise
            self.skips.record(batch.path(i), e.reason)
            dropped.append(i)
            row[KernelRow.HEIGHT:] = (1, 1, 0, 0, 1, 1, 0)  # any valid row: the output is dropped
            return
        off = int(row[KernelRow.OFFSET])
        flat[off : off + s * s * 3].copy_(self._device.host(batch.slot.images[i]).view(-1), non_blocking=True)
        row[KernelRow.HEIGHT:] = (s, s, 0, 0, s, s, 0)
        self.decoded_by["cpu"] += 1

    def _buffer(self, nbytes: int, turn: bool) -> torch.Tensor:
        """The first ``nbytes`` of one of the two decode buffers, taken in turn, so a batch decodes while the
        previous one's kernel is still to run; each is reused every other batch (a batch's decode comes after
        the last kernel that read that buffer: ``CudaDecoding.submit``)."""
        self._device.order_buffers()
        if turn:
            self._turn ^= 1
        return self._flats[self._turn][:nbytes]

    def _submit_decode(self, batch: "HostBatch", part: "_Part") -> list[Future]:
        """Queue the decode of the part's encoded samples into its buffer (local row j as an (h, w, 3) uint8
        image at its offset): calls of about ``job_images`` (at least one per decoder), dealt in turn to the
        decoders. Returns the calls' futures; ``_await_decode`` says which images worked."""
        ids = part.r.start + part.enc
        if not len(ids):
            return []
        slot, flat = batch.slot, part.flat
        job = DecodeJob((slot.arena.ctypes.data + ids * slot.arena.strides[0]).astype(np.uint64),
                        slot.meta[ids, Meta.LENGTH].astype(np.uint64), (flat.data_ptr() + part.offsets).astype(np.uint64),
                        part.heights, part.widths, self.device, (slot.arena, flat))
        # calls of equal size (within one image) and at most job_images (what nvJPEG took memory for), dealt in
        # turn to the decoders
        nd = len(self.decoders)
        calls = max(nd, -(-len(ids) // self.job_images))
        bounds = np.round(np.arange(calls + 1) * len(ids) / calls).astype(int).tolist()
        return self._device.submit([(j % nd, job[a:b]) for j, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a])

    def _await_decode(self, futures: list[Future]) -> list[bool]:
        """Wait for the decode calls (all of them, even when one failed: none may still write after an
        error is raised), order the current stream after them, count what they decoded; which worked."""
        wait(futures)
        errors = [f.exception() for f in futures]
        # the calls that ran are ordered before this stream's next work, also when another one failed
        done = self._device.collect([f.result() for f, e in zip(futures, errors) if e is None])
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed
        ok = [bool(good) for part in done for good in part]
        self.decoded_by[f"gpu:{self.name}"] += sum(ok)
        return ok


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _only_the_pool(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is referred to by ``t`` alone (and the temporary storage object asked): no
    tensor handed out, and no view of one, is alive. A PyTorch without the storage count cannot say: never."""
    return _STORAGE_USE_COUNT is not None and _STORAGE_USE_COUNT(t.untyped_storage()._cdata) == 2


@dataclass
class _Part:
    """One slice of a batch in a decode buffer: its samples ``r``; the local rows of its encoded samples
    (``enc``) with their byte offsets and decoded extents; the kernel's table (K, 8)."""

    r: range
    enc: np.ndarray
    flat: torch.Tensor
    offsets: np.ndarray
    heights: np.ndarray
    widths: np.ndarray
    table: np.ndarray


@dataclass
class _Started:
    """A batch between ``start`` and ``finish``."""

    batch: "HostBatch"
    part: _Part | None = None
    decoding: list | None = None  # the current part's decode futures, until awaited
    out: torch.Tensor | None = None
    dropped: list = field(default_factory=list)
    released: bool = False

    def release(self) -> None:
        """Hand the batch's slot back (once: a slot handed back twice would be given to two batches)."""
        if not self.released:
            self.released = True
            self.batch.release()


class GpuStage:
    """HostBatch -> Delivered on the GPU path, in two steps one batch apart (the Prefetcher's staged
    transform): ``GpuDecodeAugment``'s start and finish, then the per-sample ops, keeping the batch's count.
    The stage hands each ring slot back itself, once the GPU has read it (``issued`` is None)."""

    issued = None

    def __init__(self, decode: GpuDecodeAugment, per_sample) -> None:
        self.decode, self.per_sample = decode, per_sample
        self.name, self.decoded_by, self.read_on = decode.name, decode.decoded_by, decode.read_on

    def start(self, batch: "HostBatch") -> _Started:
        return self.decode.start(batch)

    def finish(self, started: _Started) -> Delivered:
        batch = started.batch
        images, labels = self.decode.finish(started)  # may put stand-ins in batch.indices
        return Delivered(*self.per_sample(images, labels, batch), batch.indices, batch.consumed)
