"""ImageLoader: wires source, sampling, scheduling, workers, the device-side stage and transfer, and holds the
public API.

    CPU decode:  Source ─► ShardedSampler ─► Scheduler ─► WorkerPool (decode + crop/resize/flip, uint8)
                                                              │ shared-memory ring, (B, S, S, 3) uint8
                                                              ▼
                                                          Prefetcher ─► stage.HostStage on `device`: normalise,
                                                                        per-sample ops ─► (images, labels)

    GPU decode:  Source ─► ShardedSampler ─► Scheduler ─► WorkerPool (read bytes, header, crop box; the CPU's
                                                              │       share decoded to rows; odd files finished)
                                                              │ shared-memory ring: bytes, rows, boxes
                                                              ▼
                                                          Prefetcher ─► stage.GpuStage on the side stream:
                                                                        decode, one fused crop/resize/flip/
                                                                        normalise kernel, per-sample ops

    With pixel ops in the recipe the crops stay uint8 for them, which normalise after. The recipe's
    MixUp/CutMix runs after the per-sample ops; another batch transform runs on the consumer's stream, in the
    consumer's thread.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from .augment.mix import BatchMix, read_batch_transform
from .decode.base import DEFAULT_MAX_PIXELS, SkipLog
from .iteration import OneAtATime
from .options import (DEFAULT_BATCH_TIMEOUT, DEFAULT_MAX_BYTES, DEFAULT_SAMPLE_TIMEOUT, DecodeOptions, ErrorPolicy,
                      OrderOptions)
from .pipeline import create_pipeline, read_settings
from .sampling import STATE_VERSION, check_loader_state
from .sources import Source
from .sources.base import fingerprint
from .workers.records import OutputSize

__all__ = ["ImageLoader", "resolve_device"]

_log = logging.getLogger("gpufeed")
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


class ImageLoader:
    """Batches of augmented images on ``device``: ``for images, labels in loader``.

    Yields ``(images, labels)``: images (B, 3, S, S) ``dtype`` on ``device``, normalised with ``mean``/``std``
    (ImageNet's by default; channels_last when asked); labels (B,) int64 on ``device`` ((B, num_classes) float
    after a MixUp/CutMix ``batch_transform``). ``loader.stats`` says what ran: each decoder's images, the CPU
    share, skipped files, the ops on the device and in the workers.

    Args:
        source: a folder (``DATA/<class>/<image>``), a ``path,label`` file list, tar shards, Parquet files,
            URLs of either (``s3://``, ``gs://``, ``az://``, ``https://``, brace ranges, lists), or a Source.
        storage_options: given to fsspec for URLs.

        batch_size: samples per batch on each rank.
        train: True (default): RandomResizedCrop(``image_size``, 224 by default) and a horizontal flip, a new
            order each epoch. False: torchvision's ``Resize(resize_size)`` + ``CenterCrop(image_size)`` in a
            fixed order; on the GPU path the GPU decoders and the CPU workers decode together and the device
            resizes in Pillow's arithmetic (``augment.center_crop``), giving torchvision's pixels.
        image_size, resize_size: the output side S, and validation's resize of the shorter side.
        transform: the torchvision ``Compose`` the script would give a Dataset, read for its settings in place
            of ``train``, ``image_size``, ``resize_size``, ``mean`` and ``std`` (``augment.recipe``). The sizing
            ops, flips, to-tensor ops and Normalize are gpufeed's; the per-sample ops with a device version run
            on the device where their place lets them (``placement.ops``, ``loader.stats["ops_on_device"]``);
            any other op, a user's own callable included, runs per sample in the CPU workers as torchvision's
            own, said once in a warning and in ``loader.stats["ops_in_workers"]``.
        batch_transform: torchvision's ``v2.MixUp``, ``v2.CutMix`` or a ``v2.RandomChoice`` of them, run on
            each finished batch after the per-sample ops, drawn from the loader's seed (``augment.mix``: a
            resumed epoch mixes as the first run did); any other ``batch_transform(images, labels)`` is called
            on each finished batch on ``device``, on the consumer's stream, before it is yielded.
        dtype, channels_last, mean, std: what the delivered images look like.

        seed: with the epoch, the order (``sampling``). ``state_dict()`` records how many samples of the
            epoch were delivered; ``load_state_dict`` resumes with exactly the rest, on any number of ranks.
        rank, world_size: the shard (None: from ``torch.distributed`` or torchrun's environment); sharding
            follows ``DistributedSampler``, except that shards read whole are dealt to ranks.
        drop_last: drop the ragged tail, across ranks and in the last batch (default: True for training,
            False for validation, whose last batch is smaller).

        device: "auto" (CUDA when there is one), "cpu", "cuda" or "cuda:N".
        decode: "auto" (default): the first of nvJPEG (the NVJPG hardware engines through its batched API)
            and nvImageCodec that works on a CUDA device, else the CPU workers; "gpu": those, else
            torchvision's nvJPEG; "nvjpeg", "nvimgcodec" or "torchvision" force one (an impossible choice
            raises); "cpu": the CPU worker processes. ``loader.decode_backend`` says which was used and
            ``loader.decode_reason`` why.
        cpu_share: on the GPU path, the fraction of each batch the CPU workers decode beside the GPU decoders
            ("auto": ``placement.ShareControl``; ``loader.stats["cpu_share"]`` gives the current value). There
            the workers stay off a few physical cores (``loader.worker_cpus``, ``placement.worker_cpus``), so
            the threads feeding the GPU decoders and the training loop never wait for a core.
        num_workers: worker processes (None: this process's usable cores shared among the node's ranks).
        prefetch_depth: batches on the device ahead of the training step.
        max_gpu_memory: bytes the loader may hold on the GPU: its decode buffers and output batches are sized
            at construction (``placement.gpu_memory``, ``loader.stats["gpu_memory_budget"]``) and never grow;
            batches that need more go through in slices.
        exif_orientation: apply EXIF rotation before cropping (default: ignored, as torchvision does).

        on_error: "raise" (default) stops at the first file that cannot be read or decoded, with an error
            naming it. "skip" drops it and counts it in ``loader.stats`` (``skipped_count``), logging one line
            per epoch: in training a good sample of the same batch takes its place (``repeated``), so every
            batch keeps its size and every rank its batch count, labels staying with their images; in
            validation the batch is smaller, and one with no file left is not yielded. An outage (over half
            the epoch, or ten batches in a row with nothing loaded: ``options.is_outage``) raises, naming the
            first file.
        max_pixels, max_bytes: images whose header claims more pixels are refused before any allocation,
            files larger than ``max_bytes`` (256 MiB) before they are read.
        num_classes: labels outside [0, num_classes) are bad samples, named.
        sample_timeout, batch_timeout: seconds for one sample's read and decode (300; a worker over it is
            replaced) and for a whole batch (600; the error names the workers and the samples in flight);
            None lifts either.
        verify_checksums: check each shard of a ``gpufeed shards`` folder against its manifest's sha256, hashed
            at most once per loader on each machine (a remote shard as soon as its copy is fetched, a local one on
            its first read; ``loader.stats["shards_hashed"]``); a changed shard fails its samples, naming it
            (skipped and counted under "skip").

    The settings are kept, grouped and validated, in ``loader.augment`` (at the size in effect),
    ``loader.normalize``, ``loader.order``, ``loader.decoding`` and ``loader.errors``.

    Progressive resizing: ``loader.set_image_size(160)`` between epochs makes smaller batches from the next
    iteration on, up to ``image_size`` (``max_image_size``), with the same workers and memory;
    ``state_dict()`` carries the size in effect.
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str] | Source,
        *,
        batch_size: int = 256,
        train: bool | None = None,
        image_size: int | None = None,
        resize_size: int | None = None,
        device: str | torch.device = "auto",
        num_workers: int | None = None,
        dtype: torch.dtype | None = None,
        channels_last: bool = False,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool | None = None,
        prefetch_depth: int = 2,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        decode: str = "auto",
        on_error: str = "raise",
        exif_orientation: bool = False,
        sample_timeout: float | None = DEFAULT_SAMPLE_TIMEOUT,
        max_bytes: int = DEFAULT_MAX_BYTES, num_classes: int | None = None,
        batch_timeout: float | None = DEFAULT_BATCH_TIMEOUT,
        verify_checksums: bool = False,
        cpu_share: float | str = "auto",
        max_gpu_memory: int | None = None,
        storage_options: dict[str, Any] | None = None,
        batch_transform: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
        transform: Any = None,
    ) -> None:
        _check_batch_transform(batch_transform)
        settings = read_settings(transform, train=train, image_size=image_size, resize_size=resize_size, mean=mean,
                                 std=std, dtype=dtype, channels_last=channels_last)
        self.augment, self.normalize, self.sample_ops = settings.augment, settings.normalize, settings.sample_ops
        # validation sees its whole set unless told otherwise; training keeps every batch full
        self.order = OrderOptions(batch_size=batch_size, drop_last=self.augment.train if drop_last is None else drop_last,
                                  seed=seed, rank=rank, world_size=world_size)
        self.decoding = DecodeOptions(decode=decode, cpu_share=cpu_share, num_workers=num_workers,
                                      prefetch_depth=prefetch_depth, exif_orientation=exif_orientation,
                                      max_gpu_memory=max_gpu_memory)
        self.errors = ErrorPolicy(on_error=on_error, max_pixels=max_pixels, sample_timeout=sample_timeout,
                                  max_bytes=max_bytes, batch_timeout=batch_timeout, num_classes=num_classes,
                                  verify_checksums=verify_checksums)
        self.device = resolve_device(device)
        pipeline = create_pipeline(source, settings=settings, decoding=self.decoding, errors=self.errors,
                                   order=self.order, device=self.device, storage_options=storage_options)
        self.source, self.sampler, self.spec = pipeline.source, pipeline.sampler, pipeline.spec
        self.batch_size, self.drop_last = self.order.batch_size, self.order.drop_last
        self.max_image_size = self.augment.image_size  # what the ring and GPU batches hold (``set_image_size``)
        self.num_workers, self.decode_reason = pipeline.num_workers, pipeline.decode_reason
        self.gpu_memory, self.worker_cpus = pipeline.gpu_memory, pipeline.worker_cpus
        self._skips, self._share, self._per_sample = pipeline.skips, pipeline.share, pipeline.per_sample
        self._stage, self._scheduler, self._prefetcher = pipeline.stage, pipeline.scheduler, pipeline.prefetcher
        self._checksums = pipeline.checksums
        self._iterations = OneAtATime("this ImageLoader")
        self._placed = False  # load_state_dict set the position the next iteration starts from
        self._said_going_on = False  # a training iteration going on mid-epoch is said once
        self._gpu_stage = getattr(self._stage, "decode", None)  # the GPU path's decode, for stats and tests
        self.decode_backend = self._stage.name
        self.batch_indices: list[int] = []  # the source indices of the batch last yielded
        self.batch_transform = batch_transform  # read now (the property below)

    # -- public API ---------------------------------------------------------
    @property
    def batch_transform(self) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """The batch transform (see the class docstring). Setting it takes effect for the batches made from
        then on; the few already made (``prefetch_depth`` and the one being finished) keep what they were made
        with."""
        return self._batch_transform

    @property
    def batch_mix(self) -> BatchMix | None:
        """What the loader read of ``batch_transform`` and runs itself (None: it is called as given)."""
        return self._per_sample.mix

    @batch_transform.setter
    def batch_transform(self, transform: Any) -> None:
        _check_batch_transform(transform)
        mix = read_batch_transform(transform) if transform is not None else None
        classes = len(getattr(self.source, "classes", ()) or ())
        if mix is not None and classes > mix.num_classes:
            raise ValueError(f"batch_transform {transform!r} has num_classes={mix.num_classes}, but the data has "
                             f"{classes} classes: its labels would not fit")
        self._batch_transform, self._per_sample.mix = transform, mix

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning: its order and draws. The position ``load_state_dict`` placed in
        that same epoch is kept (a resumed loop calls ``set_epoch`` with the epoch it resumes)."""
        if epoch == self.sampler.epoch and not self._placed:
            self.sampler.restart()  # a position a break or a peek left is not a resume
        else:
            self.sampler.set_epoch(epoch)

    def set_image_size(self, image_size: int, *, resize_size: int | None = None) -> None:
        """Make ``image_size`` squares from the next iteration on (progressive resizing): the training crop
        resizes to it (a RandomCrop takes a window of that size, its padding unchanged); validation, and a
        Resize before a RandomCrop, resize the shorter side to ``resize_size`` (default: in the loader's ratio
        of resize to crop, ``round(image_size x 256 / 224)`` unless it was made with another); validation
        centre-crops it.
        An op the size cannot take (GaussianBlur wider than the image) raises here, naming both. At most ``max_image_size`` (the ``image_size`` the loader was made
        with), whose shared memory and GPU batches hold any smaller size: nothing is allocated and the same
        worker processes go on. An iteration under way keeps its size; an epoch broken off goes on at the
        new one. The batches are those a loader made with this size gives (same seed, same crops)."""
        if not isinstance(image_size, int) or image_size < 1:
            raise ValueError(f"image_size must be an integer >= 1, got {image_size!r}")
        if image_size > self.max_image_size:
            raise ValueError(f"image_size={image_size} is over the loader's max_image_size={self.max_image_size}, "
                             "which sized its shared memory and GPU batches: make the loader with the largest size "
                             "it will be set to")
        self.sample_ops.check_size(image_size)
        if self.spec.worker_ops is not None:
            self.spec.worker_ops.check_size(image_size, self.max_image_size)
        self.augment = self.augment.at_size(image_size, resize_size)

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch stands (``sampling``), with the format ``version`` and the ``source``'s fingerprint
        (its sample count and a digest of its paths or URLs and labels, computed once per loader)."""
        return {"version": STATE_VERSION, "source": dict(self._fingerprint), "sampler": self.sampler.state_dict(),
                "batch_size": self.batch_size, "image_size": self.augment.image_size,
                "resize_size": self.augment.resize_size}

    @functools.cached_property
    def _fingerprint(self) -> dict[str, Any]:
        return fingerprint(self.source)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (``state_dict()`` of this loader or another on the same data), with its image
        size when it has one. The state is checked first (``sampling.check_loader_state``): a ``ValueError``
        names what does not match (keys, types, a later format version, another source), and nothing is
        changed then."""
        check_loader_state(state, self._fingerprint)
        previous = self.augment
        if "image_size" in state:  # first: a size this loader cannot take raises before anything changed
            self.set_image_size(state["image_size"], resize_size=state.get("resize_size"))
        try:
            self.sampler.load_state_dict(state["sampler"])
        except BaseException:
            self.augment = previous
            raise
        self._placed = True

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This epoch's batches from where it stands; validation's from the start of its pass, unless
        ``load_state_dict`` placed it (``iteration``: one iteration at a time; a later ``iter()`` in the same
        thread ends a live one, from another thread it raises)."""
        return self._iterations.begin(self._batches)

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # a validation pass cut short (a peek with next(iter(loader)), a break) would score part of the set
        if not self.augment.train and not self._placed:
            self.sampler.restart()
        elif not self._placed and not self.sampler.at_epoch_start and not self._said_going_on:
            self._said_going_on = True
            warnings.warn(f"gpufeed: this iteration goes on with epoch {self.sampler.epoch} where the last one "
                          f"stopped ({self.sampler.position} of its {len(self.sampler)} samples on this rank already "
                          f"taken: a break, or a peek with next(iter(loader))); loader.set_epoch({self.sampler.epoch}) "
                          "starts it over", stacklevel=3)
        self._placed = False
        self._skips.epoch = 0
        # the stream the batches are read on: a reused output batch waits for the work queued there
        self._stage.read_on(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        size = OutputSize(self.augment.image_size, self.augment.resize_size)
        batches = self._prefetcher.iterate(self._scheduler.batches(self.sampler, size))
        try:
            for out in batches:
                self.sampler.advance(out.consumed)
                if not len(out.labels):  # validation, every file failed under "skip": recorded, not yielded
                    continue
                self.batch_indices = out.indices
                images = out.images
                if self.batch_transform is None or self.batch_mix is not None:
                    yield images, out.labels
                else:  # on the device, on the consumer's stream, as the user would call it
                    yield self.batch_transform(images, out.labels)
        finally:
            batches.close()  # done, broken off or dropped: stop the prefetch thread and the scheduler
        if self._skips.epoch:
            _log.warning("gpufeed: skipped %d undecodable sample(s) in epoch %d (%d in all); loader.stats['skipped'] "
                         "lists them, e.g. %s", self._skips.epoch, self.sampler.epoch, self._skips.total,
                         self._skips.listed[-1][0])
        # An epoch run to its end moves on to the next (a fresh order, as DataLoader's shuffle
        # gives); `set_epoch` still sets it explicitly. A `break` leaves the position as it is.
        self.sampler.set_epoch(self.sampler.epoch + 1)

    def close(self) -> None:
        """Stop the worker processes now (they also stop when the loader is garbage-collected)."""
        self._scheduler.close()

    @property
    def stats(self) -> dict[str, Any]:
        """Which backend decoded how many images so far (GPU path) and why this backend, the CPU share, the
        CPUs the workers run on (None: all of this process's), whether the batch ring is page-locked for
        CUDA copies (None before the workers start), the GPU memory budget in bytes (``placement.gpu_memory``;
        0 for a CPU device); what runs the auto-augment family's colour and point operations on CUDA (None
        without them or on a CPU device); the recipe's per-sample ops that run on the loader's device
        (``ops_on_device``) and those the CPU workers run (``ops_in_workers``: those that do not run on the
        device, and those among them; ``placement.ops``); under ``on_error="skip"``
        the number of skipped samples, (path, reason) for the first 10,000, and how many samples stood in for
        them (``repeated``); under either policy, a tar's members named like images that are never read (links,
        devices, FIFOs), which are no samples: ``left_out_count``, and (path, reason) of the first 10,000 in
        ``left_out`` (a remote shard's once its copy is fetched); under ``verify_checksums``, how many times this
        loader hashed a shard (``shards_hashed``: at most once per shard on each machine, again for a copy fetched
        again; None otherwise)."""
        by = dict(self._stage.decoded_by)
        pool = self._scheduler.pool
        return {"decode_backend": self.decode_backend, "decode_reason": self.decode_reason, "decoded_by": by,
                "cpu_share": round(self._share.value, 3),
                "worker_cpus": sorted(self.worker_cpus) if self.worker_cpus is not None else None,
                "ring_page_locked": pool.page_locked if pool is not None else None,
                "gpu_memory_budget": self.gpu_memory.total if self.device.type == "cuda" else 0,
                "auto_augment_ops": self.sample_ops.auto_augment_runner(self.device),
                "ops_on_device": list(self.sample_ops.names),
                "ops_in_workers": list(self.spec.worker_ops.names) if self.spec.worker_ops is not None else [],
                "skipped_count": self._skips.total, "skipped": list(self._skips.listed),
                "repeated": self._skips.repeated, "shards": getattr(self.source, "shard_options", None),
                **_left_out(self.source), "shards_hashed": _shards_hashed(self._checksums)}

    def __enter__(self) -> "ImageLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        pool = self._scheduler.pool
        return pool.pids if pool is not None else []


def _left_out(source: Any) -> dict[str, Any]:
    """A tar source's members never read (links, devices, FIFOs named like images): their count and the first
    ``SkipLog.LISTED`` (path, reason)."""
    left_out = list(getattr(source, "left_out", ()))
    return {"left_out_count": len(left_out), "left_out": left_out[: SkipLog.LISTED]}


def _shards_hashed(checksums: Any) -> int | None:
    """How many times this loader's shards were hashed for ``verify_checksums`` (None when it is off)."""
    return sum(checksums.hashed().values()) if checksums is not None else None


def _check_batch_transform(transform: Any) -> None:
    if transform is not None and not callable(transform):
        raise TypeError(f"batch_transform must be callable as f(images, labels), got {transform!r}")
