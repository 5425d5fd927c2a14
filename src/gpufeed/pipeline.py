"""The one factory that makes a loader's stages from its option groups, and the settings read from a recipe.

    options (frozen groups) ─► create_pipeline ─► source, sampler, placement's choices, worker spec,
                                                  device-side stage, scheduler, Prefetcher

``ImageLoader`` turns its keyword arguments into the groups (``options``, ``AugmentSpec``, ``Normalize``) and
calls ``create_pipeline`` once; nothing in the pipeline refers back to the loader, so a dropped loader (and its
workers and shared memory) goes at once, without a garbage collection.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from . import placement
from .augment.normalize import IMAGENET_MEAN, IMAGENET_STD, Normalize
from .augment.ops import SampleOps
from .augment.params import AugmentSpec, default_resize_size
from .augment.recipe import read_transform
from .augment.worker_ops import WorkerOps
from .decode.base import SkipLog
from .decode.cpu import say_if_whole_image_decode
from .options import DecodeOptions, ErrorPolicy, OrderOptions
from .sampling import ShardedSampler, local_world_size, resolve_rank
from .schedule import Scheduler
from .sources import Source, create_source
from .sources.urls import is_url
from .stage import GpuStage, HostStage, PerSample, create_stage
from .transfer import Prefetcher
from .workers import PipelineSpec, WorkerPool
from .workers.pool import check_source_importable

# the consumer's own wait for a batch on CUDA outlasts the pool's batch_timeout: the pool's error, naming the
# workers and samples, comes first
_PREFETCH_GRACE_S = 30.0


@dataclass(frozen=True)
class Settings:
    """What the samples become: the crop (``augment``), the delivered tensors (``normalize``), the recipe's
    per-sample ops on the device (``sample_ops``) and those the CPU workers run (``worker_ops``)."""

    augment: AugmentSpec
    normalize: Normalize
    sample_ops: SampleOps
    worker_ops: WorkerOps | None = None


def read_settings(transform: Any, *, train: bool | None, image_size: int | None, resize_size: int | None,
                  mean: Sequence[float] | None, std: Sequence[float] | None, dtype: torch.dtype | None,
                  channels_last: bool) -> Settings:
    """The settings from a torchvision ``transform`` (read for its parameters, in place of ``train``, the sizes,
    ``mean`` and ``std``: giving one of them beside it with another value raises, naming both), or from those
    arguments and their defaults (training, 224, ``round(224 x 256 / 224)``, ImageNet's constants)."""
    for name, value in (("image_size", image_size), ("resize_size", resize_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            pair = isinstance(value, (tuple, list)) and value and all(isinstance(v, int) for v in value)
            raise TypeError(f"{name} must be one integer (the loader makes square images), got {value!r}"
                            + (f": give one side, e.g. {name}={max(value)}" if pair else ""))
    recipe = None
    if transform is not None:
        recipe = read_transform(transform)
        own = {"train": recipe.train, "image_size": recipe.image_size, "mean": recipe.mean, "std": recipe.std}
        given = {"train": train, "image_size": image_size, "mean": mean, "std": std}
        clash = [f"{k}={v!r} (the transform's: {own[k]!r})" for k, v in given.items()
                 if v is not None and (tuple(v) if k in ("mean", "std") else v) != own[k]]
        if resize_size is not None:
            clash.append(f"resize_size={resize_size!r} (the transform's Resize sets it)")
        if clash:
            raise ValueError(f"transform= sets these itself; leave out {', '.join(clash)}")
        if recipe.dtype is not None and dtype is not None and recipe.dtype != dtype:
            raise ValueError(f"dtype={dtype} but the transform casts to {recipe.dtype}; give one of them")
        mean, std, dtype = recipe.mean, recipe.std, recipe.dtype or dtype
        augment = AugmentSpec(**recipe.augment_kwargs())
    else:
        image_size = 224 if image_size is None else image_size
        mean = IMAGENET_MEAN if mean is None else mean
        std = IMAGENET_STD if std is None else std
        augment = AugmentSpec(train=True if train is None else train, image_size=image_size,
                              resize_size=resize_size or default_resize_size(image_size))
    normalize = Normalize(mean=tuple(mean), std=tuple(std), dtype=torch.float32 if dtype is None else dtype,
                          channels_last=channels_last)
    # the recipe's per-sample ops on each delivered batch (pixel ops such as ColorJitter, RandomErasing)
    ops = SampleOps(pixel=recipe.pixel if recipe else (), erasing=recipe and recipe.erasing, mean=mean, std=std,
                    names=recipe.device if recipe else ())
    return Settings(augment, normalize, ops, recipe.workers if recipe else None)


@dataclass(frozen=True)
class Pipeline:
    """A loader's stages, made once (``create_pipeline``)."""

    source: Source
    sampler: ShardedSampler
    num_workers: int
    decode_reason: str
    gpu_memory: placement.GpuMemory
    spec: PipelineSpec
    worker_cpus: set[int] | None
    skips: SkipLog
    share: placement.ShareControl
    per_sample: PerSample
    stage: GpuStage | HostStage
    scheduler: Scheduler
    prefetcher: Prefetcher
    checksums: Any = None  # verify_checksums: this loader's copy of the source's (``_verify_checksums``)


def create_pipeline(source: Any, *, settings: Settings, decoding: DecodeOptions, errors: ErrorPolicy,
                    order: OrderOptions, device: torch.device,
                    storage_options: dict[str, Any] | None = None) -> Pipeline:
    """The stages for ``source`` (a path, URLs or a Source) on ``device``, each policy asked of ``placement``."""
    _check_storage_options(source, storage_options)
    augment, normalize, batch = settings.augment, settings.normalize, order.batch_size
    src = create_source(source, storage_options=storage_options)
    check_source_importable(src)
    checksums = _verify_checksums(src, source) if errors.verify_checksums else None
    rank, world_size = resolve_rank(order.rank, order.world_size)
    sampler = ShardedSampler(len(src), shuffle=augment.train, seed=order.seed, rank=rank, world_size=world_size,
                             drop_last=order.drop_last, groups=getattr(src, "groups", None),  # a grouped order
                             window=getattr(src, "window", 4), units=getattr(src, "units", None), batch_size=batch)
    if order.drop_last and len(sampler) < batch:  # else every epoch would silently do nothing
        on_rank = f" on rank {rank} of {world_size}" if world_size > 1 else ""
        raise ValueError(f"{len(sampler)} samples{on_rank} make no batch of batch_size={batch} with drop_last=True, "
                         f"so an epoch would yield nothing: give a batch_size of at most {len(sampler)}, or "
                         f"drop_last=False")
    local_ranks = local_world_size(world_size)
    num_workers = decoding.num_workers or placement.default_num_workers(local_ranks)
    worker_ops = settings.worker_ops
    cpu_reason = placement.cpu_crops(augment) or (worker_ops.why_cpu if worker_ops is not None else None)
    gpu_decoders, reason = placement.create_gpu_decoders(decoding.decode, device, recipe=cpu_reason, batch_size=batch)
    gpu_path = gpu_decoders is not None
    _warn_unused(device, gpu_path, reason, decoding)
    say_if_whole_image_decode()
    if worker_ops is not None:
        warnings.warn(worker_ops.warning(), stacklevel=3)
    # in ``dtype`` also where the GPU stage writes uint8 for pixel ops: their output batches are in flight instead
    memory = placement.gpu_memory(batch_size=batch, image_size=augment.image_size,
                                  itemsize=torch.empty((), dtype=normalize.dtype).element_size(),
                                  prefetch_depth=decoding.prefetch_depth,
                                  gpu_decoders=len(gpu_decoders) if gpu_path else 0,
                                  max_gpu_memory=decoding.max_gpu_memory)
    workers_normalise = (device.type == "cpu" and not settings.sample_ops.pixel  # pixel ops start from uint8
                         and num_workers >= placement.WORKERS_NORMALISE_FROM)
    spec = PipelineSpec(source=src, augment=augment, max_pixels=errors.max_pixels,
                        gpu_bytes_capacity=placement.GPU_BYTES_CAPACITY if gpu_path else 0,
                        gpu_buffer_bytes=memory.buffer_bytes, on_error=errors.on_error,
                        exif_orientation=decoding.exif_orientation, max_bytes=errors.max_bytes,
                        num_classes=errors.num_classes,
                        normalize=normalize.for_workers() if workers_normalise else None, worker_ops=worker_ops)
    worker_cpus = placement.worker_cpus(gpu_path, local_ranks)
    skips = SkipLog()
    share = placement.ShareControl(decoding.cpu_share if gpu_path else 1.0,
                                   training_cores_kept=worker_cpus is not None)
    per_sample = PerSample(settings.sample_ops, normalize)
    stage = create_stage(gpu_decoders, per_sample, device=device, image_size=augment.image_size, normalize=normalize,
                         max_pixels=errors.max_pixels, memory=memory, batch_size=batch,
                         skips=skips if errors.skips else None, crop="box" if augment.train else "center")
    num_slots = placement.ring_slots(decoding.prefetch_depth, gpu_path)
    start_pool = functools.partial(_start_pool, spec, num_workers=num_workers, num_slots=num_slots, batch_size=batch,
                                   sample_timeout=errors.sample_timeout, cpus=worker_cpus,
                                   page_lock=device.type == "cuda", batch_timeout=errors.batch_timeout)
    scheduler = Scheduler(start_pool=start_pool, num_slots=num_slots, batch_size=batch, drop_last=order.drop_last,
                          share=share, skips=skips, path=src.path, cuda=device.type == "cuda",
                          readahead=getattr(src, "readahead", None),
                          stand_ins=augment.train)  # validation counts each image once: a bad one leaves its batch
    timeout = errors.batch_timeout and errors.batch_timeout + _PREFETCH_GRACE_S
    prefetcher = Prefetcher(device=device, depth=decoding.prefetch_depth, transform=stage, on_issued=stage.issued,
                            on_take=share.taken, timeout=timeout)
    return Pipeline(src, sampler, num_workers, reason, memory, spec, worker_cpus, skips, share, per_sample, stage,
                    scheduler, prefetcher, checksums)


def _verify_checksums(src: Any, source: Any) -> Any:
    """Turn on ``src``'s check of each shard against its manifest's sha256, and return this loader's checks;
    ValueError when it has none."""
    checksums = getattr(src, "manifest_checksums", None)
    if checksums is None or not hasattr(src, "checksums"):
        shown = source if isinstance(source, (str, os.PathLike)) else type(source).__name__
        raise ValueError(f"verify_checksums=True checks shards against the manifest.json `gpufeed shards` writes "
                         f"beside them, and {str(shown)!r} has none: give the folder `gpufeed shards` wrote, or "
                         "verify_checksums=False")
    spool = getattr(src, "spool", None)  # remote shards, Parquet: answers kept in their spool; else a folder of its own
    # another loader over the same Source may be reading through the folder its copy holds: kept, not replaced
    src.checksums = checksums.shared(spool.root if spool is not None else None, like=src.checksums)
    return src.checksums


def _check_storage_options(source: Any, storage_options: dict[str, Any] | None) -> None:
    """``storage_options`` go to the URLs the loader opens itself; anywhere else they would be dropped."""
    if storage_options is None:
        return
    if isinstance(source, Source):
        raise ValueError(f"storage_options= applies to URLs ImageLoader opens itself, but the source is a "
                         f"{type(source).__name__} made beforehand: give storage_options to the function that made "
                         "it (remote_tar_source(..., storage_options=...), parquet_source(..., storage_options=...))")
    names = list(source) if isinstance(source, (list, tuple)) else [source]
    local = [str(n) for n in names
             if not (isinstance(n, str) and is_url(n) and not (n.startswith("file://") and "{" not in n))]
    if local:
        raise ValueError(f"storage_options= applies to URLs (s3://, gs://, az://, https://), but {local[0]!r} is a "
                         "local path, read without fsspec")


def _warn_unused(device: torch.device, gpu_path: bool, reason: str, decoding: DecodeOptions) -> None:
    """One line for each option that cannot apply to this loader, said when it is made."""
    if not gpu_path and decoding.cpu_share != "auto":
        warnings.warn(f"gpufeed: cpu_share={decoding.cpu_share!r} has no effect: every sample is decoded by the CPU "
                      f"workers ({reason})", stacklevel=4)
    if device.type != "cuda" and decoding.max_gpu_memory is not None:
        warnings.warn(f"gpufeed: max_gpu_memory={decoding.max_gpu_memory!r} has no effect on device {str(device)!r}",
                      stacklevel=4)


def _start_pool(spec: PipelineSpec, *, page_lock: bool, **kw: Any) -> WorkerPool:
    pool = WorkerPool(spec, **kw)
    if page_lock:
        pool.pin_images()
    return pool
