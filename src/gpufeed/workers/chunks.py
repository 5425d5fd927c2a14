"""What a worker does with a chunk of samples: read, decode, crop and resize them into a ring slot.

CPU path: every sample is decoded, cropped, resized and flipped here into the slot's pixels; for a CPU
device also normalised here into the slot's float32 output, so no single process does that for a batch.
GPU path: every sample is read and its header parsed; a plain JPEG that fits goes into the slot as bytes
with its crop box, for a GPU decoder (``KIND_BYTES``; for validation the resized extent and the centre
crop's corner in its place, ``records.Meta``); the chunk's share for the CPU (``cheapest_on_cpu``) is
decoded here down to its crop's rows, which the GPU kernel resizes (``KIND_ROWS``; validation's share is
resized and cropped here, as on the CPU path, ``KIND_PIXELS``); files no GPU decoder should see are
finished here (``KIND_PIXELS``).
A recipe with ops that do not run on the device (``augment.worker_ops``) takes the CPU path on every device:
each sample is also run through them here, after its crop (or from the whole image, where they hold it).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..decode.crop import decode_box_into, decode_box_rows_into, decode_random_crop_into, decode_resize_crop_into
from ..augment.in_workers import WorkerNormalize
from ..augment.params import AugmentSpec, CropBox, ResizeCrop
from ..decode.base import DecodeError
from ..decode.cpu import CpuDecoder
from ..decode.exif import apply_orientation, read_orientation, swaps_axes
from ..placement.samples import Candidate, cheapest_on_cpu, gpu_may_take
from ..ring import KIND_BYTES, KIND_PIXELS, KIND_ROWS, Ring
from ..sources.base import Source, check_label, read_capped
from .records import Failure, OutputSize, Progress, Task

if TYPE_CHECKING:
    from ..augment.worker_ops import WorkerOps


@dataclass(frozen=True)
class PipelineSpec:
    """Everything a worker needs to turn a sample index into pixels (picklable)."""

    source: Source
    augment: AugmentSpec
    max_pixels: int
    gpu_bytes_capacity: int = 0  # > 0: leave JPEGs encoded for GPU decode, up to this many bytes each
    gpu_buffer_bytes: int = 0  # a GPU decode buffer's size: larger decoded images are finished here
    on_error: str = "raise"  # "raise": stop at the first bad sample; "skip": report it and go on
    exif_orientation: bool = False  # apply EXIF orientation (default: ignore it, as torchvision does)
    normalize: WorkerNormalize | None = None  # a CPU device: also write each image's final float32 values
    max_bytes: int | None = None  # larger samples are refused, unread where the source can tell (gpufeed's can)
    num_classes: int | None = None  # labels must lie in [0, num_classes)
    worker_ops: WorkerOps | None = None  # the recipe's ops that do not run on the device, run per sample here

    def __post_init__(self) -> None:
        if self.worker_ops is not None and self.gpu_bytes_capacity:
            raise ValueError(f"the recipe's {', '.join(self.worker_ops.own)} run in the CPU workers, which then decode "
                             f"every sample: gpu_bytes_capacity must be 0, got {self.gpu_bytes_capacity}")

    @property
    def needs_main(self) -> bool:
        """Whether the workers need the training script (``__main__``) imported: the source's class, or one of
        the recipe's ops run in the workers, is defined there."""
        ops = self.worker_ops
        return type(self.source).__module__ == "__main__" or (ops is not None and ops.main_module)

    @property
    def raises(self) -> bool:
        """Whether the first bad sample stops the batch (``on_error="raise"``; "skip" goes on)."""
        return self.on_error == "raise"


def _read(spec: PipelineSpec, index: int) -> tuple[str, bytes]:
    path = spec.source.path(index)
    try:
        return path, read_capped(spec.source, index, spec.max_bytes)
    except OSError as e:
        raise DecodeError(path, f"cannot read the file ({type(e).__name__}: {e.strerror or e})") from None


def _label(spec: PipelineSpec, index: int, path: str) -> int:
    """Sample ``index``'s label, checked: an integer in [0, ``num_classes``), else a ValueError naming ``path``."""
    return check_label(spec.source.label(index), path, spec.num_classes)


def _finish_on_cpu(spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, index: int, path: str,
                   data: bytes, out: np.ndarray, header: tuple[int, int, bool] | None = None,
                   orientation: int | None = None) -> None:
    """Decode, orient, crop, resize and flip one sample into ``out`` ((S, S, 3) uint8). ``header``
    (``decoder.header(data, path)``) and ``orientation`` when the caller has them already."""
    width, height, fast = header or decoder.header(data, path)
    if orientation is None:
        orientation = read_orientation(data) if spec.exif_orientation else 1
    if swaps_axes(orientation):
        width, height = height, width
    if not spec.augment.train:
        geometry = spec.augment.resize_crop(width, height)
        decode_resize_crop_into(decoder, data, path, geometry, (width, height), fast, out, orientation)
        return
    if spec.augment.crop is not None:
        try:
            at = spec.augment.random_crop(width, height, seed=seed, epoch=epoch, index=index)
        except ValueError as e:  # an image smaller than the crop: this file's failure
            raise DecodeError(path, str(e)) from None
        decode_random_crop_into(decoder, data, path, spec.augment.crop, at, (width, height), fast, out, orientation)
        return
    box = spec.augment.draw(width, height, seed=seed, epoch=epoch, index=index)
    decode_box_into(decoder, data, path, box, (width, height), fast, out, orientation)


def load_sample_into(spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, index: int,
                     out: np.ndarray) -> int:
    """CPU path: read, decode and augment sample ``index`` into ``out`` ((S, S, 3) uint8); its label."""
    path, data = _read(spec, index)
    _finish_on_cpu(spec, decoder, seed, epoch, index, path, data, out)
    return _label(spec, index, path)


def load_sample_with_ops(spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, index: int,
                         out: np.ndarray) -> int:
    """CPU path of a recipe with ops run here (``spec.worker_ops``): ``load_sample_into``, then those ops on the
    crop; or, where they hold the crop, the whole image decoded and run through them. Its label."""
    ops = spec.worker_ops
    path, data = _read(spec, index)
    if ops.from_decode:
        _, _, fast = decoder.header(data, path)
        orientation = read_orientation(data) if spec.exif_orientation else 1
        image = apply_orientation(decoder.decode(data, path, fast=fast), orientation)
    else:
        _finish_on_cpu(spec, decoder, seed, epoch, index, path, data, out)
        image = out
    ops.apply(image, out, seed=seed, epoch=epoch, index=index)
    return _label(spec, index, path)


@dataclass
class Inspected:
    """A GPU-path sample read and looked at, not yet placed: whether a GPU decoder may take it, and then
    its crop box (None otherwise; validation: the part of the image its square is made from) and, for
    validation, its Resize + CenterCrop geometry."""

    index: int
    path: str
    data: bytes
    header: tuple[int, int, bool]  # width, height, fast (libjpeg-turbo decodes it to RGB)
    orientation: int
    gpu_ok: bool
    box: CropBox | None
    geometry: ResizeCrop | None = None

    @property
    def candidate(self) -> Candidate:
        return Candidate(len(self.data), self.header[1], self.box)


def inspect_sample(spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, index: int) -> Inspected:
    """GPU path, first step: read sample ``index``, parse its header and decide whether a GPU decoder may
    take it (``placement.gpu_may_take``); draw its box if so."""
    path, data = _read(spec, index)
    header = width, height, fast = decoder.header(data, path)
    orientation = read_orientation(data) if spec.exif_orientation else 1
    gpu_ok = gpu_may_take(data, header, orientation, bytes_capacity=spec.gpu_bytes_capacity,
                          buffer_bytes=spec.gpu_buffer_bytes)
    augment, box, geometry = spec.augment, None, None
    if gpu_ok and augment.train:
        box = augment.draw(width, height, seed=seed, epoch=epoch, index=index)
    elif gpu_ok:
        box, geometry = augment.center_box(width, height), augment.resize_crop(width, height)
    return Inspected(index, path, data, header, orientation, gpu_ok, box, geometry)


def place_sample(spec: PipelineSpec, decoder: CpuDecoder, seed: int, epoch: int, s: Inspected, ring: Ring,
                 slot: int, k: int, on_cpu: bool) -> int:
    """GPU path, second step: put the JPEG bytes and crop box at position ``k`` of the slot for GPU
    decode; or (``on_cpu``) decode the crop's rows here and leave them with the box for the GPU to
    resize (``KIND_ROWS``; when they fit in the position's pixel room, else as below); or (no GPU
    decoder may take it, or validation's share) decode, crop and resize it here. Its label."""
    width, height, fast = s.header
    box, g = s.box, s.geometry
    if s.gpu_ok and not on_cpu:
        ring.arena[slot, k, : len(s.data)] = np.frombuffer(s.data, np.uint8)
        place = (box.x, box.y, box.width, box.height, int(box.flip)) if g is None else (g.left, g.top, g.width,
                                                                                          g.height, 0)
        ring.meta[slot, k] = (KIND_BYTES, len(s.data), width, height, *place)
        return _label(spec, s.index, s.path)
    if s.gpu_ok and g is None:  # the CPU's share: a plain JPEG that passed the structural check, its box drawn already
        rows = decode_box_rows_into(decoder, s.data, s.path, box, (width, height), spec.augment.image_size,
                                    ring.rooms[slot, k])
        if rows is not None:
            w, h, x, y, bw, bh = rows
            ring.meta[slot, k] = (KIND_ROWS, w * h * 3, w, h, x, y, bw, bh, int(box.flip))
            return _label(spec, s.index, s.path)
        decode_box_into(decoder, s.data, s.path, box, (width, height), fast, ring.images[slot, k])
    else:
        _finish_on_cpu(spec, decoder, seed, epoch, s.index, s.path, s.data, ring.images[slot, k], s.header,
                       s.orientation)
    ring.meta[slot, k] = (KIND_PIXELS, 0, width, height, 0, 0, 0, 0, 0)
    return _label(spec, s.index, s.path)


class ChunkServer:
    """A worker's view of the ring and its decoder; ``serve`` loads one chunk."""

    def __init__(self, spec: PipelineSpec, shm_name: str, ring_shape: tuple[int, int, int]) -> None:
        self.spec = spec
        self._shm = shared_memory.SharedMemory(name=shm_name)
        self.ring = Ring(self._shm, *ring_shape, spec.gpu_bytes_capacity,
                         spec.normalize.layout if spec.normalize is not None else None)
        self.ring.map_pages()
        self.decoder = CpuDecoder(max_pixels=spec.max_pixels)
        self._at: dict[OutputSize, PipelineSpec] = {}
        self._load = self._gpu_chunk if spec.gpu_bytes_capacity else self._cpu_chunk  # the path, chosen once
        self._sample = load_sample_into if spec.worker_ops is None else load_sample_with_ops

    def at(self, size: OutputSize) -> tuple[PipelineSpec, Ring]:
        """The spec and ring views for batches made at ``size`` (progressive resizing: the spec's own size
        or a smaller one)."""
        if size not in self._at:
            augment = self.spec.augment.at_size(size.image, size.resize)
            self._at[size] = dataclasses.replace(self.spec, augment=augment)
        return self._at[size], self.ring.at(size.image)

    def close(self) -> None:
        del self.ring
        self._shm.close()

    def serve(self, task: Task, progress: Progress) -> list[Failure]:
        """Load ``task``'s samples into its slot; the failures. ``progress`` holds the sample in hand."""
        (spec, ring), slot = self.at(task.size), task.slot
        failures: list[Failure] = []

        def attempt(k: int, index: int, fn: Callable, *args):  # a failure is reported; the main process decides
            progress.hold(task.batch_id, task.chunk_id, k, time.monotonic())
            try:
                return fn(*args)
            except Exception as e:
                tb = traceback.format_exc() if spec.raises else ""
                failures.append(Failure(k, spec.source.path(index), f"{type(e).__name__}: {e}", tb))
                return None

        def settle(k: int, index: int, fn: Callable, *args) -> bool:  # ``attempt`` of a function giving the label;
            label = attempt(k, index, fn, *args)                     # False once the chunk should stop
            if label is not None:
                ring.labels[slot, k] = label
            return not (failures and spec.raises)

        self._load(spec, ring, task, attempt, settle)
        return failures

    def _cpu_chunk(self, spec: PipelineSpec, ring: Ring, task: Task, attempt: Callable, settle: Callable) -> None:
        """CPU path: every sample decoded, cropped and resized here (and normalised, for a CPU device)."""
        slot = task.slot
        for k, index in enumerate(task.indices, task.start):
            go_on = settle(k, index, self._sample, spec, self.decoder, task.seed, task.epoch, index,
                           ring.images[slot, k])
            if spec.normalize is not None:  # on this worker's core, while the image is in its cache
                spec.normalize.into(ring.images[slot, k], ring.output[slot, k])
            if not go_on:
                return

    def _gpu_chunk(self, spec: PipelineSpec, ring: Ring, task: Task, attempt: Callable, settle: Callable) -> None:
        """GPU path: the whole chunk is looked at first (files no GPU decoder takes are finished at once and
        count in the CPU's part), then the CPU decodes the rest of its quota from the chunk's cheapest samples."""
        slot, seed, epoch, decoder = task.slot, task.seed, task.epoch, self.decoder
        gpu_ok: dict[int, Inspected] = {}
        forced = 0
        for k, index in enumerate(task.indices, task.start):
            sample = attempt(k, index, inspect_sample, spec, decoder, seed, epoch, index)
            go_on = not (sample is None and spec.raises)
            if sample is not None and sample.gpu_ok:
                gpu_ok[k] = sample
            elif sample is not None:
                forced += 1
                go_on = settle(k, index, place_sample, spec, decoder, seed, epoch, sample, ring, slot, k, True)
            if not go_on:
                return
        on_cpu = cheapest_on_cpu({k: s.candidate for k, s in gpu_ok.items()}, task.cpu_quota - forced)
        for k, sample in gpu_ok.items():
            if not settle(k, sample.index, place_sample, spec, decoder, seed, epoch, sample, ring, slot, k,
                          k in on_cpu):
                return
