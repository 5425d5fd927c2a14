"""ImageLoader: wires source, sampling, decode/augment workers and transfer.

    CPU decode:  Source ─► ShardedSampler ─► WorkerPool (decode + crop/resize/flip, uint8)
                                                 │ shared-memory ring, (B, S, S, 3) uint8
                                                 ▼
                                             Prefetcher ─► Normalize on `device` ─► (images, labels)

    GPU decode:  Source ─► ShardedSampler ─► WorkerPool (read bytes, header, crop box; odd files decoded)
                                                 │ shared-memory ring: bytes + boxes
                                                 ▼
                                             Prefetcher ─► GpuDecodeAugment on the side stream
                                                           (decode, one fused crop/resize/flip/normalise kernel)
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .augment.normalize import IMAGENET_MEAN, IMAGENET_STD, Normalize
from .augment.params import AugmentSpec
from .cores import IdleCores, worker_cpus
from .decode.base import DEFAULT_MAX_PIXELS
from .decode.placement import create_gpu_decoder
from .gpu_stage import EncodedBatch, GpuDecodeAugment
from .transfer import Prefetcher
from .sampling import ShardedSampler, resolve_rank
from .sources import Source, create_source
from .workers import PipelineSpec, WorkerPool, check_source_importable, default_num_workers

__all__ = ["ImageLoader", "resolve_device"]

_log = logging.getLogger("gpufeed")
_MAX_SKIPS_LISTED = 10_000

# Per-sample room for encoded bytes in the shared ring on the GPU path; larger files are decoded by the
# CPU workers instead (ImageNet's largest training JPEGs are a few MB; the mean is ~110 KB).
GPU_BYTES_CAPACITY = 2 * 1024 * 1024

# GPU path: cores kept free of workers per rank (two decoder threads and the training loop). On the H200's
# 16 cores, loader only, same share in the same call: 0.15, 2 kept 23,173 against none 22,334 / 23,135 (S6-1);
# 0.25, 3 kept 24,264 against none 22,690 (S6-2); auto, 3 kept 25,048 / 24,512 against none 24,189 / 24,002
# (S6-8). ResNet-18 with auto: 77.6% of its rate, 69.6% before.
KEPT_CORES = 3


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> the current CUDA device if there is one, else CPU; validates anything else."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here (use 'cpu' or 'auto')")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return dev


def _local_world_size(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size if world_size > 1 else 1))


class ImageLoader:
    """Batches of augmented images on ``device``, from a folder, a file list or a Source.

    Yields ``(images, labels)``: images (B, 3, S, S) ``dtype`` on ``device``,
    normalised with ``mean``/``std`` (channels_last when asked); labels (B,)
    int64 on ``device``. ``train=True``: RandomResizedCrop(``image_size``) and
    horizontal flip, a new order each epoch; ``train=False``: resize the
    shorter side to ``resize_size``, centre-crop, fixed order.

    ``decode``: "cpu" decodes in CPU worker processes; "gpu" decodes on the
    GPU: the NVJPG hardware engines through nvJPEG's batched API, else
    nvImageCodec (engines, then its CUDA decoder), else torchvision's nvJPEG;
    "nvjpeg", "nvimgcodec" or "torchvision" force one (an impossible choice
    raises); "auto" (default) is the first of nvJPEG/nvImageCodec that works
    on a CUDA device, else the CPU workers. ``loader.decode_backend`` says
    which was used, ``loader.decode_reason`` why, and ``loader.stats`` how
    many images each decoder handled.

    Epoch order is a function of (seed, epoch); sharding follows
    ``DistributedSampler`` (rank/world_size from ``torch.distributed`` when
    initialised). ``drop_last`` drops the ragged tail both across ranks and in
    the last batch. ``state_dict()`` records how many samples of the epoch were
    delivered; ``load_state_dict`` resumes with exactly the rest.

    Bad input: ``on_error="raise"`` (default) stops at the first file that
    cannot be read or decoded, with an error naming it; ``"skip"`` drops it,
    refills the batch from the next samples (labels stay with their images),
    counts it in ``loader.stats`` and logs one line per epoch. ``max_pixels``
    rejects images whose header claims more pixels, before any allocation.
    ``sample_timeout`` (seconds) bounds one sample's decode; a worker over it
    is replaced. ``exif_orientation=True`` applies EXIF rotation (default:
    ignored, as torchvision does).

    ``cpu_share`` (GPU decode only): the fraction of each batch that the CPU
    workers decode beside the GPU decoders (each chunk's cheapest samples to
    decode on the CPU: only the crop's rows, which the GPU kernel resizes with
    the rest of the batch). "auto" adapts it as it goes: the workers take as much
    as they keep up with while a quarter of the cores stay idle for the
    training process, the GPU decoders the rest (``_ShareControl``).
    ``loader.stats["cpu_share"]`` gives the current value. On the GPU path the
    workers stay off the lowest few physical cores of this process's affinity mask
    (``loader.worker_cpus``; none kept below 8 cores), so that the threads
    feeding the GPU decoders and the training loop never wait for a core.
    """

    def __init__(
        self,
        source: str | os.PathLike | Source,
        *,
        batch_size: int = 256,
        train: bool = True,
        image_size: int = 224,
        resize_size: int | None = None,
        device: str | torch.device = "auto",
        num_workers: int | None = None,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = True,
        prefetch_depth: int = 2,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        decode: str = "auto",
        on_error: str = "raise",
        exif_orientation: bool = False,
        sample_timeout: float | None = None,
        cpu_share: float | str = "auto",
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 or None, got {num_workers}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if sample_timeout is not None and sample_timeout <= 0:
            raise ValueError(f"sample_timeout must be > 0 seconds or None, got {sample_timeout}")
        if not (cpu_share == "auto" or (isinstance(cpu_share, (int, float)) and 0 <= cpu_share <= 1)):
            raise ValueError(f"cpu_share must be 'auto' or a fraction in [0, 1], got {cpu_share!r}")
        self._share = _ShareControl(cpu_share)
        self.on_error, self.sample_timeout = on_error, sample_timeout
        self._consumed: collections.deque = collections.deque()
        self._skipped: list[tuple[str | None, str]] = []
        self._skipped_total = self._skipped_epoch = 0
        self.device = resolve_device(device)
        self.normalize = Normalize(mean=tuple(mean), std=tuple(std), dtype=dtype, channels_last=channels_last)
        augment = AugmentSpec(
            train=train, image_size=image_size, resize_size=resize_size or round(image_size * 256 / 224)
        )
        self.source = create_source(source)
        check_source_importable(self.source)
        rank, world_size = resolve_rank(rank, world_size)
        self.sampler = ShardedSampler(
            len(self.source), shuffle=train, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last
        )
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers or default_num_workers(_local_world_size(world_size))
        gpu_decoders, self.decode_reason = create_gpu_decoder(decode, self.device)
        self.spec = PipelineSpec(source=self.source, augment=augment, max_pixels=max_pixels,
                                 gpu_bytes_capacity=GPU_BYTES_CAPACITY if gpu_decoders else 0,
                                 on_error=on_error, exif_orientation=exif_orientation)
        # GPU path: the workers stay off a few cores, which the threads feeding the GPU decoders and the
        # training loop then never wait for (KEPT_CORES per rank on this node, at most a quarter of the
        # cores; none under 8 cores)
        self.worker_cpus = (worker_cpus(KEPT_CORES * _local_world_size(world_size)) if gpu_decoders
                            else None)
        self._pool: WorkerPool | None = None
        self._ahead: _Run | None = None  # the next epoch's first batches, submitted at the end of this one
        self._last_slots: _Slots | None = None
        # one slot more on the GPU path: the GPU stage holds a batch until the next one is started
        self._num_slots = max(4, prefetch_depth + 2) + (gpu_decoders is not None)
        if gpu_decoders is None:
            self.decode_backend = "cpu"
            self._gpu_stage = None
            transform = self.normalize
        else:
            self._gpu_stage = GpuDecodeAugment(
                gpu_decoders, device=self.device, image_size=image_size, mean=mean, std=std, dtype=dtype,
                channels_last=channels_last, max_pixels=max_pixels,
                on_skip=_weak_method(self._record_skip) if on_error == "skip" else None)
            self.decode_backend = self._gpu_stage.name
            transform = self._gpu_stage
        self._prefetcher = Prefetcher((), self.device, depth=prefetch_depth, transform=transform)

    # -- public API ---------------------------------------------------------
    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        host = self._prefetcher.iterable = self._host_batches()
        self._skipped_epoch = 0
        batches = iter(self._prefetcher)
        try:
            for images, labels in batches:
                self.sampler.advance(self._consumed.popleft())
                yield images, labels
        finally:
            # Done, broken off or dropped: stop the prefetch thread, then let go of the host-side generator.
            # It holds this loader, so keeping it would make the loader live until a garbage collection,
            # workers, shared memory and GPU buffers included.
            batches.close()
            if self._prefetcher.iterable is host:  # not a later iteration's
                self._prefetcher.iterable = ()
        if self._skipped_epoch:
            _log.warning("gpufeed: skipped %d undecodable sample(s) in epoch %d (%d in all); loader.stats['skipped'] "
                         "lists them, e.g. %s", self._skipped_epoch, self.sampler.epoch, self._skipped_total,
                         self._skipped[-1][0])
        # An epoch run to its end moves on to the next (a fresh order, as DataLoader's shuffle
        # gives); `set_epoch` still sets it explicitly. A `break` leaves the position as it is.
        self.sampler.set_epoch(self.sampler.epoch + 1)

    def close(self) -> None:
        """Stop the worker processes now (they also stop when the loader is garbage-collected)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def stats(self) -> dict[str, Any]:
        """Which backend decoded how many images so far (GPU path) and why this backend, the CPU share, the
        CPUs the workers run on (None: all of this process's); under ``on_error="skip"`` the number of
        skipped samples and (path, reason) for the first 10,000."""
        by = dict(self._gpu_stage.decoded_by) if self._gpu_stage is not None else {}
        return {"decode_backend": self.decode_backend, "decode_reason": self.decode_reason, "decoded_by": by,
                "cpu_share": round(self._share.value, 3) if self._gpu_stage is not None else 1.0,
                "worker_cpus": sorted(self.worker_cpus) if self.worker_cpus is not None else None,
                "skipped_count": self._skipped_total, "skipped": list(self._skipped)}

    def __enter__(self) -> "ImageLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        return self._pool.pids if self._pool is not None else []

    # -- internals ----------------------------------------------------------
    def _host_batches(self) -> Iterator[Any]:
        """Per batch, views of a ring slot: CPU decode gives (images (B, S, S, 3) uint8, labels (B,) int64)
        CPU tensors; GPU decode gives an ``EncodedBatch`` (bytes and crop boxes) for the GPU stage.

        Batches are cut from the epoch order as they are submitted. Under ``on_error="skip"`` a batch
        with bad samples is compacted and refilled from the next samples of the order (batches that
        were already queued behind it are cancelled and cut again), so delivered samples always form
        a prefix of the order minus the skipped ones, and ``state_dict`` stays exact. For each
        yielded batch the number of order entries it consumed is appended to ``self._consumed``.

        Across epochs: once this epoch's last batches are with the workers, free slots take the first
        batches of the next epoch (epoch + 1, from its start, where the loader moves on by itself), so
        the next epoch starts without a pipeline bubble. They are kept if the next iteration is that
        epoch from its start, and cancelled otherwise (``set_epoch`` elsewhere, ``load_state_dict``, a
        ``break``).

        A slot is reused only after the Prefetcher issued its copies (it asks for the next batch) and,
        on CUDA, once those copies completed: the slots are page-locked, so the GPU reads them directly.
        """
        if self._pool is None or self._pool.closed:
            self._pool = WorkerPool(self.spec, num_workers=self.num_workers, num_slots=self._num_slots,
                                    batch_size=self.batch_size, sample_timeout=self.sample_timeout,
                                    cpus=self.worker_cpus)
            if self.device.type == "cuda":
                self._pool.pin_images()
            self._ahead = None
        if self._last_slots is not None:  # the GPU stage released the last batch's slot after that run ended
            self._last_slots.reclaim(everything=True)
        pool, sampler, size = self._pool, self.sampler, self.batch_size
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead.seed, ahead.epoch, 0) == (sampler.seed, sampler.epoch, sampler.position):
            run, slots = ahead, ahead.slots  # this epoch's first batches are already with the workers
        else:
            pool.cancel()  # an earlier, abandoned iteration may have batches in flight
            slots = _Slots(self._num_slots)
            run = _Run(sampler.seed, sampler.epoch, sampler.remaining(), slots)
        self._consumed.clear()
        full = lambda n: n == size or (n > 0 and not self.drop_last)
        nxt: _Run | None = None  # the next epoch's run, started early
        finished = False
        try:
            while True:
                slots.reclaim()
                self._submit(run, full)
                if nxt is None and not full(min(size, len(run.order) - run.cursor)):
                    nxt = _Run(run.seed, run.epoch + 1, sampler.epoch_indices(run.epoch + 1), slots)
                if nxt is not None:
                    self._submit(nxt, full)
                if not run.inflight:
                    finished = True
                    return
                bid, slot, idx = run.inflight.popleft()
                view, failures = pool.collect(bid)
                collect_wait = pool.last_wait
                consumed, positions = len(idx), list(idx)
                if failures:
                    pool.cancel()  # drops every queued batch: this epoch's later ones and the next epoch's
                    for _, later_slot, later_idx in run.inflight:
                        slots.free.append(later_slot)
                        run.cursor -= len(later_idx)
                    slots.free.extend(later_slot for _, later_slot, _ in (nxt.inflight if nxt else ()))
                    run.inflight.clear()
                    nxt = None
                    view, positions, extra = self._refill(slot, view, positions, failures, run)
                    consumed += extra
                if not full(len(positions)):
                    slots.free.append(slot)
                    finished = True
                    return  # the epoch's good samples ran out for a full batch (drop_last); the epoch ends
                self._consumed.append(consumed)
                labels = torch.from_numpy(view.labels.copy())  # tiny: never alias a slot that gets reused
                if view.meta is None:
                    yield torch.from_numpy(view.images), labels
                    # Back here when the Prefetcher wants the next batch: it has issued this one's copies on
                    # its stream, which may still be reading the slot.
                    slots.release(slot, self._prefetcher._stream)
                else:  # the GPU stage releases the slot when it is done with it (it finishes a batch late)
                    yield EncodedBatch(labels, view.meta, view.arena, view.images,
                                       lambda i, p=positions: self.source.path(p[i]),
                                       release=lambda s=slot: slots.release(s, self._prefetcher._stream),
                                       rooms=view.rooms)
                    self._share.update(collect_wait)
        finally:
            slots.reclaim(everything=True)  # the next iteration's workers may write these slots at once
            self._last_slots = slots
            if self._pool is not None and self._pool.closed:  # stopped by an error: fresh workers next time
                self._pool = None
            elif finished and nxt is not None and nxt.inflight:
                self._ahead = nxt
            elif self._pool is not None:
                self._pool.cancel()

    def _submit(self, run: "_Run", full) -> None:
        """Hand ``run``'s next whole batches to the workers while a slot is free (one kept for the consumer)."""
        slots = run.slots
        while len(slots.free) > 1 and full(min(self.batch_size, len(run.order) - run.cursor)):
            idx = run.order[run.cursor : run.cursor + self.batch_size]
            bid, slot = next(slots.ids), slots.free.popleft()
            self._pool.submit(bid, slot, run.seed, run.epoch, idx, cpu_rows=round(self._share.value * len(idx)))
            run.inflight.append((bid, slot, idx))
            run.cursor += len(idx)

    def _refill(self, slot, view, positions, failures, run: "_Run"):
        """Drop failed samples from a slot, move the rest to the front, top it up from ``run``'s order
        (advancing its cursor); returns the slot's view, its samples' positions and the entries taken."""
        pool, target, extra = self._pool, len(positions), 0
        while failures:
            bad = {f.position for f in failures}
            retry = [positions[f.position] for f in failures if f.reason == "retry"]
            for f in failures:
                if f.reason != "retry":
                    self._record_skip(f.path, f.reason)
            keep = [k for k in range(len(positions)) if k not in bad]
            for arr in (view.pixels, view.labels, view.meta, view.arena):  # images are a view of the pixels
                if arr is not None:
                    arr[: len(keep)] = arr[keep]
            positions = [positions[k] for k in keep]
            fresh = run.order[run.cursor : run.cursor + max(0, target - len(positions) - len(retry))]
            run.cursor += len(fresh)
            extra += len(fresh)
            take = retry + fresh
            if not take:
                break
            bid = next(run.slots.ids)
            pool.submit(bid, slot, run.seed, run.epoch, take, start=len(positions))
            view, failures = pool.collect(bid)
            positions += take
        return view.head(len(positions)), positions, extra

    def _record_skip(self, path: str | None, reason: str) -> None:
        self._skipped_total += 1
        self._skipped_epoch += 1
        if len(self._skipped) < _MAX_SKIPS_LISTED:
            self._skipped.append((path, reason))


class _Slots:
    """The ring's slots as one iteration sees them: free, or handed over and maybe still read by the GPU."""

    def __init__(self, num_slots: int) -> None:
        self.free: collections.deque = collections.deque(range(num_slots))
        self.reading: collections.deque = collections.deque()  # (slot, CUDA event after its copies)
        self.ids = itertools.count()  # batch ids for the pool

    def release(self, slot: int, stream: torch.cuda.Stream | None) -> None:
        if stream is None:
            self.free.append(slot)
            return
        event = torch.cuda.Event()
        event.record(stream)
        self.reading.append((slot, event))

    def reclaim(self, everything: bool = False) -> None:
        """Free the slots whose copies finished; wait for the oldest when fewer than two are free, or
        for all of them with ``everything``."""
        while self.reading and (everything or len(self.free) <= 1 or self.reading[0][1].query()):
            slot, event = self.reading.popleft()
            event.synchronize()
            self.free.append(slot)


@dataclass
class _Run:
    """One epoch's order as it is handed to the workers: ``cursor`` entries so far, ``inflight``
    (batch id, slot, indices) submitted and not yet collected."""

    seed: int
    epoch: int
    order: list[int]
    slots: _Slots
    cursor: int = 0
    inflight: collections.deque = field(default_factory=collections.deque)


class _ShareControl:
    """The CPU workers' share of each GPU-path batch: fixed, or adapted ("auto").

    The workers take what they keep up with without starving the training process of cores: at the
    end of every ``IdleCores.WINDOW_S`` window of batches, the share goes down if fewer than
    ``reserve`` cores (a quarter) stayed idle or if most batches were late (the GPU stage waited more
    than ``LATE_S`` for them), and up if neither and at least one more core than that stayed idle. When training is the slower side this puts on the workers much of what the CPU
    can decode (a GPU decode spends the training process's time, its Python thread and the GIL, which
    the worker processes do not touch); when the GPU decoders are the slower side the CPU takes a part
    beside them without crowding out the process that feeds them. On the H200 machine (16 cores, the
    workers off 3 of them: ``KEPT_CORES``), loader only, auto settled at 0.16-0.25 (20,554-25,242 images/s
    in six calls; the engines alone 18,147-21,196; fixed 0.25 and 0.3 no better, 0.35 slower); training,
    ResNet-50 at 1.00 (98.1% of its own rate) and ResNet-18 at 0.56 (77.6%, against 76.8% at 0; before
    the kept cores it was 69.6%): BENCHMARKS.md, session 6. Steps of 1/32, up one a window; down one
    for late batches, or one per core missing from the reserve (at most ``MAX_DOWN_STEPS``), so a share
    too high for the CPU comes down within a few windows (from the start at 0.5, loader only: about 9
    windows at one step each). Up stays one step: while the workers start and at epoch boundaries the
    cores idle with no batch to decode, and larger steps up then left the share too high (BENCHMARKS.md,
    session 8). A change reaches batches submitted from then on, a few batches later.
    """

    STEP, LATE_S, MAX_DOWN_STEPS = 1 / 32, 0.002, 4

    def __init__(self, setting: float | str, idle: IdleCores | None = None) -> None:
        self.auto = setting == "auto"
        self.value = 0.5 if self.auto else float(setting)
        self._idle = (idle or IdleCores()) if self.auto else None
        self.reserve = max(1.0, self._idle.capacity / 4) if self.auto else 0.0
        self._batches = self._late = 0

    def update(self, collect_wait: float) -> None:
        if not self.auto:
            return
        self._batches += 1
        self._late += collect_wait > self.LATE_S
        idle = self._idle.poll()
        if idle is None:
            return
        if idle < self.reserve:  # the workers crowd the cores the training process needs
            steps = min(self.MAX_DOWN_STEPS, max(1, round(self.reserve - idle)))
            self.value = max(0.0, self.value - steps * self.STEP)
        elif 2 * self._late > self._batches:  # they do not keep up
            self.value = max(0.0, self.value - self.STEP)
        elif idle >= self.reserve + 1:
            self.value = min(1.0, self.value + self.STEP)
        self._batches = self._late = 0


def _weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` called through a weak reference to its object: a callback the loader hands to a part it
    owns (the GPU stage), which must not keep the loader alive (a reference cycle lives until a garbage
    collection, and the loader's workers and shared memory with it)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call
