"""The GPU stage: decode a batch on the GPU and crop/resize/flip/normalise it in one kernel.

Input is an ``EncodedBatch`` that CPU workers filled: per sample the JPEG
bytes and crop box (``kind == KIND_BYTES``), or the rows of the crop they
decoded and the box within them (``KIND_ROWS``: the CPU's share of the
batch, resized here with the rest), or pixels they already cropped and
resized (``KIND_PIXELS``: files no GPU decoder takes, and shares whose rows
did not fit in the ring). It runs as the Prefetcher's transform, on its side stream, in its
background thread, in two steps: ``start`` lays batch k+1 out and hands its
JPEGs to the decoder threads, then ``finish`` completes batch k (CPU fallbacks,
kernel); the consumer's stream waits on the event recorded after the kernel.
Two decode buffers are used in turn, so batch k+1 decodes while batch k's
kernel is still to run.

    a flat uint8 buffer on the device, in batch order, laid out from the workers' headers:
    [ image 0 (h0, w0, 3) | CPU rows of 1 | pre-cropped 2 (S, S, 3) | image 3 ... ]
          ▲ GPU decoders write here directly (threads, own streams)
                            ▲ one H2D copy each, from the ring's page-locked pixel rooms
          ▲ a file the GPU refuses: CPU decode + crop here, copied in
    ──► one fused crop/resize/flip/normalise kernel ──► (B, 3, S, S)

Decoding straight into place (no per-image tensors, no packing copy) and
handing the decoders the shared ring's memory (no bytes copies) made this
stage 2x faster on the H200 (benchmarks/profile_gpu_stage.py); addresses
computed for the whole batch at once (nvJPEG direct) and queueing the next
batch's decode before finishing the current one doubled it again
(10,597 -> 21,015 images/s loader-only, BENCHMARKS.md session 4). With
region decode on (``roi`` on the nvJPEG decoders; off by default: not faster
on the H200's engines) each image's crop box alone is decoded.
A pre-cropped image enters the kernel as an S x S image with box (0, 0, S, S),
which the kernel copies exactly while normalising; CPU-decoded rows enter it
as an image with their box, like a GPU-decoded one. Batches whose images
together exceed ``max_batch_pixels`` go through in consecutive slices, so
decode memory stays bounded.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from .augment.cpu import decode_box_into
from .augment.fused import normalize_constants, resized_crop_reference, resized_crop_triton, triton
from .augment.params import CropBox
from .decode.base import DecodeError
from .decode.cpu import CpuDecoder
from .ring import KIND_BYTES, KIND_PIXELS, KIND_ROWS

DEFAULT_MAX_BATCH_PIXELS = 256 * 1024 * 1024
# Images per decode call: a batch's GPU images go out in calls of about this many, taken in turn by the
# decoders' threads (one thread's host work may overlap another's decode). On the H200 this measured within
# noise of one call per decoder (BENCHMARKS.md, session 3, S3-2).
JOB_IMAGES = 48


@dataclass
class EncodedBatch:
    """One batch before GPU decode (host side; only ``labels`` is moved by the Prefetcher).

    labels (B,) int64; meta (B, 9) int64 (``ring.META_FIELDS``); arena (B, capacity)
    uint8 with sample i's bytes in ``arena[i, :meta[i, 1]]``; pixels (B, S, S, 3) uint8 for
    ``KIND_PIXELS`` rows; rooms (B, R) uint8, each position's pixel room (``pixels[i]`` is its
    first S x S x 3 bytes), with a ``KIND_ROWS`` sample's decoded rows in ``rooms[i, :meta[i, 1]]``
    (None: ``pixels`` is contiguous and no sample is ``KIND_ROWS``); ``path(i)`` names sample i's file
    for error messages.
    """

    labels: torch.Tensor
    meta: np.ndarray
    arena: np.ndarray
    pixels: np.ndarray
    path: Callable[[int], str]
    release: Callable[[], None] | None = None  # called once the stage no longer reads the host arrays
    rooms: np.ndarray | None = None


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
    """EncodedBatch -> ((B, 3, S, S) ``dtype`` normalised on ``device``, (B,) int64 labels).

    ``decoders``: one or more GPU decoders (``decode_into``); with several, each decodes a part of
    every batch from its own thread on its own CUDA stream.
    """

    def __init__(self, decoders: Sequence, *, device: torch.device, image_size: int, mean, std,
                 dtype: torch.dtype, channels_last: bool, max_pixels: int,
                 max_batch_pixels: int = DEFAULT_MAX_BATCH_PIXELS,
                 on_skip: Callable[[str, str], None] | None = None) -> None:
        self.decoders = list(decoders)
        self.name = self.decoders[0].name
        cuda = device.type == "cuda"
        # one thread per decoder (a decoder's calls never overlap), each on its own stream
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"gpufeed-decode-{k}") for k in
                         range(len(self.decoders))] if cuda else []
        self._streams = [torch.cuda.Stream(device) if cuda else None for _ in self.decoders]
        self.job_images = getattr(self.decoders[0], "job_images", JOB_IMAGES)
        # decoders taking whole arrays of addresses (nvJPEG direct) need only a host pointer to the ring
        self._packed = all(hasattr(d, "decode_packed") for d in self.decoders)
        # region decode: such decoders decode only each image's crop box (the kernel then crops nothing)
        self._roi = self._packed and all(getattr(d, "roi", False) for d in self.decoders)
        self.cpu = CpuDecoder(max_pixels=max_pixels)
        self.device, self.size, self.dtype, self.channels_last = device, image_size, dtype, channels_last
        self.scale, self.shift = normalize_constants(mean, std)
        self._scale_t = torch.tensor(self.scale, device=device)
        self._shift_t = torch.tensor(self.shift, device=device)
        self.max_batch_pixels = max_batch_pixels
        self.on_skip = on_skip  # None: a file no decoder reads raises DecodeError; else it is dropped and reported
        self.decoded_by: collections.Counter = collections.Counter()  # "gpu:<name>", "cpu" -> images
        self._flats: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._flat_stream: torch.cuda.Stream | None = None

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.finish(self.start(batch))

    def start(self, batch: EncodedBatch) -> "_Started":
        """Lay the batch out in a decode buffer, queue its pre-cropped rows' copy and hand its JPEGs to
        the decoder threads; returns at once (on CUDA). ``finish`` completes it: the Prefetcher starts
        batch k+1 before it finishes batch k, so the decoders always have the next batch queued.
        A batch over ``max_batch_pixels`` goes through in slices here, synchronously."""
        s, meta = self.size, batch.meta
        encoded = meta[:, 0] == KIND_BYTES
        # decoded extents: the header's (or the crop box's, decoding regions) for encoded samples, the rows'
        # for CPU-decoded rows, S x S for pre-cropped ones
        decoded_rows = meta[:, 0] == KIND_ROWS
        heights = np.where(encoded, meta[:, 7 if self._roi else 3], np.where(decoded_rows, meta[:, 3], s))
        widths = np.where(encoded, meta[:, 6 if self._roi else 2], np.where(decoded_rows, meta[:, 2], s))
        started = _Started(batch)
        parts = _slices(list(zip(widths.tolist(), heights.tolist())), self.max_batch_pixels)
        try:
            for k, r in enumerate(parts):
                if k:  # the previous slice is finished (kernel queued) before its buffer is reused
                    self._complete(started)
                started.part = self._prepare(batch, r, encoded[r.start : r.stop], heights[r.start : r.stop],
                                             widths[r.start : r.stop], turn=k == 0)
                started.decoding = self._submit_decode(batch, started.part)
        except BaseException:  # no finish will come: let the decoders stop reading, then hand the batch back
            if started.decoding:
                wait(started.decoding)
            if batch.release is not None:
                batch.release()
            raise
        return started

    def finish(self, started: "_Started") -> tuple[torch.Tensor, torch.Tensor]:
        """((B', 3, S, S) ``dtype`` on the device, (B',) labels) for a started batch; B' < B only when
        ``on_skip`` dropped files no decoder reads. Calls ``batch.release()`` once nothing reads its
        host memory any more (later GPU work is ordered on the current stream)."""
        try:
            self._complete(started)
        finally:
            if started.decoding is not None:  # failed before the decode was awaited: no thread may still read
                wait(started.decoding)
            if started.batch.release is not None:
                started.batch.release()
        out, labels = started.out, started.batch.labels
        if started.dropped:
            gone = set(started.dropped)
            keep = torch.tensor([i for i in range(len(labels)) if i not in gone], device=self.device)
            out, labels = out.index_select(0, keep), labels.index_select(0, keep)
        return out, labels

    def _complete(self, started: "_Started") -> None:
        """Await the current slice's decode, finish what the GPU refused on the CPU, run the kernel."""
        batch, part = started.batch, started.part
        ok = self._await_decode(started.decoding)
        started.decoding = None
        if started.out is None:
            n, s = len(batch.meta), self.size
            fmt = torch.channels_last if self.channels_last else torch.contiguous_format
            started.out = torch.empty((n, 3, s, s), dtype=self.dtype, device=self.device, memory_format=fmt)
        for j in (int(j) for j, good in zip(part.enc, ok) if not good):
            self._finish_on_cpu(batch, part.r.start + j, part.rows[j], part.flat, started.dropped)
        dst = started.out[part.r.start : part.r.stop]
        table = torch.from_numpy(part.rows)
        if self.device.type == "cuda" and triton is not None:
            resized_crop_triton(part.flat, self._host(table).to(self.device, non_blocking=True), self.size,
                                self.scale, self.shift, dst)
        else:
            resized_crop_reference(part.flat, table.to(self.device), self.size, self._scale_t, self._shift_t, dst)

    def _prepare(self, batch: EncodedBatch, r: range, encoded: np.ndarray, h: np.ndarray, w: np.ndarray,
                 turn: bool) -> "_Part":
        """Samples ``r`` of ``batch`` laid out in a decode buffer (local row j is sample r.start + j), the
        kernel's rows, and the copies of what the CPU filled (pre-cropped pixels, decoded rows) queued.
        ``turn``: take the other buffer than last time (the previous batch's kernel may not have run yet)."""
        s, px = self.size, self.size * self.size * 3
        local = np.arange(len(r))
        meta = batch.meta[r.start : r.stop]
        host, enc = local[~encoded], local[encoded]
        pre = local[meta[:, 0] == KIND_PIXELS]
        # what the CPU filled, in each sample's pixel room: pre-cropped S x S x 3, or the crop's decoded rows
        filled = np.where(meta[:, 0] == KIND_ROWS, meta[:, 1], px)
        # In batch order, as in the slot; encoded images get at least S x S x 3 bytes, so a GPU refusal
        # cropped on the CPU fits in its place.
        room = np.where(encoded, np.maximum(h * w * 3, px), filled)
        offset = np.concatenate([[0], np.cumsum(room)[:-1]])
        flat = self._buffer(int(room.sum()), turn)
        rows = np.empty((len(r), 8), np.int64)
        rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:] = offset, h, w, meta[:, 4:]
        if self._roi:
            rows[enc, 3:5] = 0  # the decoded region is the box
        rows[pre, 1:] = (s, s, 0, 0, s, s, 0)
        if len(host):  # one copy each (a sample's room is larger than what it holds)
            rooms = self._rooms(batch)
            for j in host.tolist():
                n = int(filled[j])
                flat[offset[j] : offset[j] + n].copy_(rooms(r.start + j, n), non_blocking=True)
        self.decoded_by["cpu"] += len(host)
        return _Part(r, enc, flat, offset[enc], h[enc], w[enc], rows)

    def _rooms(self, batch: EncodedBatch) -> Callable[[int, int], torch.Tensor]:
        """(i, n) -> the first n bytes of sample i's pixel room as a host tensor for an H2D copy (``_host``;
        the page-locked check is made once per batch). Without rooms, sample i's pixels."""
        if batch.rooms is None:  # pre-cropped pixels only
            return lambda i, n: self._host(batch.pixels[i]).view(-1)[:n]
        t = torch.from_numpy(batch.rooms)
        if self.device.type != "cuda" or t.is_pinned():
            return lambda i, n: t[i, :n]
        return lambda i, n: t[i, :n].pin_memory()

    def _finish_on_cpu(self, batch: EncodedBatch, i: int, row: np.ndarray, flat: torch.Tensor,
                       dropped: list[int]) -> None:
        """Sample ``i`` that the GPU refused: decode and crop it here, into its place in ``flat``."""
        s = self.size
        data = batch.arena[i, : batch.meta[i, 1]].tobytes()
        path = batch.path(i)
        _, _, fw, fh, x, y, bw, bh, flip = (int(v) for v in batch.meta[i])
        try:  # the workers left it encoded: a plain JPEG (header read, box drawn, orientation 1)
            decode_box_into(self.cpu, data, path, CropBox(x, y, bw, bh, bool(flip)), (fw, fh), True, batch.pixels[i])
        except DecodeError as e:
            if self.on_skip is None:
                raise
            self.on_skip(path, e.reason)
            dropped.append(i)
            row[1:] = (1, 1, 0, 0, 1, 1, 0)  # any valid row: the output is dropped
            return
        off = int(row[0])
        flat[off : off + s * s * 3].copy_(self._host(batch.pixels[i]).view(-1), non_blocking=True)
        row[1:] = (s, s, 0, 0, s, s, 0)
        self.decoded_by["cpu"] += 1

    def _buffer(self, nbytes: int, turn: bool) -> torch.Tensor:
        """One of two decode buffers, taken in turn, so a batch decodes while the previous one's kernel is
        still to run; each is reused every other batch (stream order keeps a batch's decode after the last
        kernel that read that buffer), so GPU memory stays flat however the batches' sizes vary. Each grows
        to the largest batch seen, with room to spare, and never shrinks."""
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            if self._flat_stream is not None and self._flat_stream != stream:
                stream.wait_stream(self._flat_stream)  # called from another stream than last time
            self._flat_stream = stream
        if turn:
            self._turn ^= 1
        k = self._turn
        if self._flats[k] is None or self._flats[k].numel() < nbytes:
            self._flats[k] = None  # free the old one first
            grain = 32 << 20
            self._flats[k] = torch.empty(-(-int(nbytes * 1.5) // grain) * grain, dtype=torch.uint8,
                                         device=self.device)
        return self._flats[k][:nbytes]

    def _host(self, a) -> torch.Tensor:
        """A host tensor for an H2D copy: the ring's own page-locked memory when it is (the loader reuses
        the slot after the copy), else a pinned copy (the caching host allocator keeps it until the copy ran)."""
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
        return t if self.device.type != "cuda" or t.is_pinned() else t.pin_memory()

    def _submit_decode(self, batch: EncodedBatch, part: "_Part") -> list:
        """Queue the decode of the part's encoded samples into its buffer (local row j as an (h, w, 3)
        uint8 image at its offset): calls of about ``job_images`` (at least one per decoder), dealt in
        turn to the decoders, each in its own thread on its own stream, after the work queued so far on
        the current stream (the buffer's last reader, this batch's copies). Returns the calls' futures
        (on the CPU, done ones); ``_await_decode`` says which images worked."""
        ids, offsets, heights, widths = part.r.start + part.enc, part.offsets, part.heights, part.widths
        if not len(ids):
            return []
        flat = part.flat
        if self._packed:  # addresses for the whole list at once: no Python per image
            src = (batch.arena.ctypes.data + ids * batch.arena.strides[0]).astype(np.uint64)
            lengths = batch.meta[ids, 1].astype(np.uint64)
            dst = (flat.data_ptr() + offsets).astype(np.uint64)
        cuda = self.device.type == "cuda"
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        roi = sizes = None
        if self._roi:
            roi, sizes = batch.meta[ids, 4:8], batch.meta[ids, 2:4]

        def run(k: int, sl: slice) -> tuple[list[bool], torch.cuda.Event | None]:
            stream = self._streams[k]
            if cuda:
                stream.wait_event(ready)
            if self._packed:
                ok = self.decoders[k].decode_packed(src[sl], lengths[sl], dst[sl], heights[sl], widths[sl], stream,
                                                    None if roi is None else roi[sl],
                                                    None if sizes is None else sizes[sl]).tolist()
            else:
                datas = [batch.arena[i, : batch.meta[i, 1]] for i in ids[sl]]
                outs = [flat[o : o + hh * ww * 3].view(hh, ww, 3) for o, hh, ww in
                        zip(offsets[sl].tolist(), heights[sl].tolist(), widths[sl].tolist())]
                ok = self.decoders[k].decode_into(datas, outs, stream)
            if not cuda:
                return ok, None
            done = torch.cuda.Event()
            done.record(stream)
            return ok, done

        # calls of equal size (within one image), dealt in turn to the decoders
        nd = len(self.decoders)
        calls = max(nd, round(len(ids) / self.job_images))
        bounds = np.round(np.arange(calls + 1) * len(ids) / calls).astype(int).tolist()
        jobs = [(j % nd, slice(a, b)) for j, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
        if not cuda:  # run here, but report as the threads do: an error is raised when awaited
            futures = []
            for k, sl in jobs:
                f: Future = Future()
                try:
                    f.set_result(run(k, sl))
                except Exception as e:
                    f.set_exception(e)
                futures.append(f)
            return futures
        return [self._threads[k].submit(run, k, sl) for k, sl in jobs]

    def _await_decode(self, futures: list) -> list[bool]:
        """Wait for the decode calls (all of them, even when one failed: none may still write after an
        error is raised), make the current stream wait for their GPU work, count what they decoded;
        which images worked."""
        wait(futures)
        results = [f.result() for f in futures]
        if self.device.type == "cuda":
            side = torch.cuda.current_stream(self.device)
            for _, done in results:
                side.wait_event(done)
        ok = [good for part, _ in results for good in part]
        self.decoded_by[f"gpu:{self.name}"] += sum(ok)
        return ok


@dataclass
class _Part:
    """One slice of a batch in a decode buffer: its samples ``r``; the local rows of its encoded samples
    (``enc``) with their byte offsets and decoded extents; the kernel's rows (K, 8)."""

    r: range
    enc: np.ndarray
    flat: torch.Tensor
    offsets: np.ndarray
    heights: np.ndarray
    widths: np.ndarray
    rows: np.ndarray


@dataclass
class _Started:
    """A batch between ``start`` and ``finish``."""

    batch: EncodedBatch
    part: _Part | None = None
    decoding: list | None = None  # the current part's decode futures, until awaited
    out: torch.Tensor | None = None
    dropped: list = field(default_factory=list)
