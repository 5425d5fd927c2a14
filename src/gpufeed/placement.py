"""Placement policy: who decodes what, and on which cores. Every rule that decides this at run time
lives here, once, with its reason; the loader, the workers, the GPU stage and ``gpufeed info`` ask it.

- which GPU decoder, if any (``create_gpu_decoders``), chosen once at construction;
- how many worker processes (``default_num_workers``) and which CPUs they run on (``worker_cpus``);
- which samples go to the GPU at all (``gpu_may_take``), and the GPU memory the loader holds
  (``gpu_memory``);
- what share of each GPU-path batch the CPU workers decode (``ShareControl``) and which samples of a
  chunk that share takes (``cheapest_on_cpu``, from the cost model ``cpu_cost`` / ``engine_cost``).

This module imports no torch at load time: worker processes use the cost model.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Mapping, NamedTuple

from .cores import IdleCores, usable_cores
from .cores import worker_cpus as _cpus_without

if TYPE_CHECKING:
    import torch

    from .augment.params import CropBox
    from .workers.chunks import PipelineSpec

__all__ = ["DECODE_CHOICES", "GPU_BYTES_CAPACITY", "GPU_MAX_SIDE", "KEPT_CORES", "WORKERS_NORMALISE_FROM", "Candidate",
           "GpuMemory", "ShareControl", "cheapest_on_cpu", "cpu_cost", "create_gpu_decoders", "decode_call_images",
           "default_num_workers", "engine_cost", "gpu_may_take", "gpu_memory", "worker_cpus"]

DECODE_CHOICES = ("auto", "cpu", "gpu", "nvimgcodec", "nvjpeg", "torchvision")
# what each GPU choice tries, in order; "auto" never takes torchvision's decoder, whose chroma upsampling
# differs from the CPU path's (28 dB against the CPU decode, where the other two give 88), and which runs at
# less than half nvJPEG's rate (BENCHMARKS.md#gpu-decode-backends)
_ORDER = {"auto": ("nvjpeg", "nvimgcodec"), "gpu": ("nvjpeg", "nvimgcodec", "torchvision"),
          "nvjpeg": ("nvjpeg",), "nvimgcodec": ("nvimgcodec",), "torchvision": ("torchvision",)}
# Decoder threads per loader: two keep the engines busy while one thread's host work runs
# (BENCHMARKS.md#gpu-decode-backends).
DECODER_THREADS = 2

# Per-sample room for encoded bytes in the shared ring on the GPU path; larger files are decoded by the CPU
# workers instead (ImageNet's largest training JPEGs are a few MB; the mean is ~110 KB).
GPU_BYTES_CAPACITY = 2 * 1024 * 1024

# GPU path: physical cores per rank kept free of workers, for the two decoder threads and the training loop,
# which then never wait for a core (+2-7% loader-only at the same share, ResNet-18 77.6% of its own rate
# against 69.6%: BENCHMARKS.md#cores-kept-from-the-workers). At most a quarter of the cores; none under 8.
KEPT_CORES = 3

# Decoded pixels per image each GPU decode buffer is sized for: ImageNet's training JPEGs average about
# 400 x 350 (most are 500 x 375 or smaller); a batch of larger images goes through in slices, never a bigger buffer.
BUFFER_PIXELS_PER_IMAGE = 512 * 512

# A CPU device with at least this many workers has them normalise the images they finish: one process
# normalising every batch cannot keep up with 16 workers (1.6x the DataLoader, against 3.5x with the workers
# doing it), while with 2 workers every core is busy decoding anyway and the copy out of the ring costs 5-8%
# (BENCHMARKS.md#cpu-only-machines).
WORKERS_NORMALISE_FROM = 8

# The longest side of an image the GPU decoders take; longer ones go to the CPU workers. nvJPEG's engine
# decoder would otherwise grow its own device memory whenever a call holds more or larger images than any
# before (+22 MB over 20 epochs); it is given room for a whole call of images this size once, at
# construction, and then never grows (BENCHMARKS.md#memory). ImageNet's training images are almost all smaller.
GPU_MAX_SIDE = 1024

# The NVJPG engines' cost per JPEG is 0.28 ns per byte + 10.2 us per image on the H200 (pixels barely count):
# the per-image part is worth this many bytes (BENCHMARKS.md#engine-cost-per-jpeg).
ENGINE_BYTES_PER_IMAGE = 36_000


def decode_call_images(batch_size: int, job_images: int) -> int:
    """The most images one decode call is given: a batch's encoded images are dealt to the decoder threads
    in calls of at most ``job_images`` (``GpuDecodeAugment``)."""
    return min(job_images, -(-batch_size // DECODER_THREADS))


def create_gpu_decoders(choice: str, device: "torch.device", *, train: bool = True, random_crop: bool = False,
                        batch_size: int = 256) -> tuple[list | None, str]:
    """(GPU decoders, or None for the CPU workers; why). Several decoders decode parts of a batch at once,
    each from its own thread on its own CUDA stream (their calls release the GIL). Validation samples
    (``train=False``) and RandomCrop recipes' (``random_crop``) are all the CPU workers' (``gpu_may_take``),
    so no GPU decoder is made for them.
    ``batch_size``: nvJPEG's engine decoders take their device memory for calls of that batch now.

    "gpu" and "auto" try, in order: the NVJPG hardware engines through nvJPEG's batched API called
    directly ("nvjpeg"); nvImageCodec, whose CUDA decoder also serves GPUs without engines
    ("nvimgcodec"); and, for "gpu" only, torchvision's decode_jpeg on CUDA. "auto" stays on the CPU
    workers without nvJPEG or nvImageCodec, or without Triton (the fused kernel's per-image torch
    fallback is far too slow to pick). An explicit single choice that cannot work raises ValueError
    saying why.
    """
    if choice not in DECODE_CHOICES:
        raise ValueError(f"decode must be one of {DECODE_CHOICES}, got {choice!r}")
    if choice == "cpu":
        return None, "decode='cpu' asked for"
    if not train:
        return None, ("validation: CPU workers, which reproduce torchvision's Resize + CenterCrop pixel for pixel "
                      "(BENCHMARKS.md#validation-crops)")
    if random_crop:
        return None, ("RandomCrop: CPU workers, which crop without resampling as torchvision does (the GPU decoders "
                      "serve RandomResizedCrop recipes)")
    if device.type != "cuda":
        if choice == "auto":
            return None, f"decode='auto' on {device}: CPU workers"
        raise ValueError(f"decode={choice!r} needs a CUDA device, got device={str(device)!r}")
    if choice == "auto":
        from .augment import fused

        if fused.triton is None:
            return None, "decode='auto': Triton is not installed (the fused GPU kernel needs it); CPU workers"
    reasons = []
    for name in _ORDER[choice]:
        try:
            decoders, how = _MAKERS[name](device, batch_size)
        except Exception as e:  # missing library, no engines on this GPU, decoder creation failure: "not here"
            reasons.append(f"{name} unavailable: {type(e).__name__}: {e}")
            continue
        return decoders, "; ".join(reasons + [how])
    if choice in _MAKERS:
        raise ValueError(reasons[-1])
    if choice == "auto":
        return None, ("decode='auto': " + "; ".join(reasons)
                      + "; CPU workers (pip install gpufeed[nvjpeg-cu13] or gpufeed[nvimgcodec-cu13])")
    return None, "; ".join(reasons + ["CPU decode"])


def _nvjpeg(device: "torch.device", batch_size: int) -> tuple[list, str]:
    from .decode.nvjpeg_hw import NvJpegHwDecoder

    images = decode_call_images(batch_size, NvJpegHwDecoder.job_images)
    decoders = [NvJpegHwDecoder(device, call_images=images, max_side=GPU_MAX_SIDE) for _ in range(DECODER_THREADS)]
    d = decoders[0]
    return decoders, (f"nvJPEG {'.'.join(map(str, d.version))} hardware engines ({d.engines} engines) called "
                      f"directly, {DECODER_THREADS} decoder threads ({d.library})")


def _nvimgcodec(device: "torch.device", batch_size: int) -> tuple[list, str]:
    from .decode.nvimgcodec import NvImageCodecDecoder

    return ([NvImageCodecDecoder(device) for _ in range(DECODER_THREADS)],
            f"nvImageCodec (hardware engine, then CUDA), {DECODER_THREADS} decoder threads")


def _torchvision(device: "torch.device", batch_size: int) -> tuple[list, str]:
    from .decode.torchvision_gpu import TorchvisionGpuDecoder

    return [TorchvisionGpuDecoder(device)], "torchvision decode_jpeg on CUDA"


_MAKERS = {"nvjpeg": _nvjpeg, "nvimgcodec": _nvimgcodec, "torchvision": _torchvision}


def gpu_may_take(spec: "PipelineSpec", data: bytes, header: tuple[int, int, bool], orientation: int) -> bool:
    """Whether a GPU decoder may take a sample; the CPU workers finish all others. Not: validation samples
    (the CPU reproduces torchvision's resize + centre crop pixel for pixel, BENCHMARKS.md#validation-crops;
    validation passes are short), RandomCrop recipes' (a crop without resampling, which the fused kernel
    does not make), files libjpeg-turbo cannot decode to RGB (not JPEG, CMYK), EXIF-rotated
    ones when rotation is on, files over ``spec.gpu_bytes_capacity``, images larger decoded than a decode
    buffer (``spec.gpu_buffer_bytes``) or with a side over ``GPU_MAX_SIDE``, and files that fail the structural check (truncated, corrupt,
    progressive: GPU decoders fill damage in silently; ``decode.jpeg_check``)."""
    from .decode.jpeg_check import gpu_safe_jpeg

    width, height, fast = header
    return (spec.augment.box_crop and fast and orientation == 1 and len(data) <= spec.gpu_bytes_capacity
            and width * height * 3 <= spec.gpu_buffer_bytes and max(width, height) <= GPU_MAX_SIDE
            and gpu_safe_jpeg(data))


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


def default_num_workers(local_world_size: int = 1) -> int:
    """One worker per core this process may use (affinity mask and cgroup CPU quota,
    ``cores.usable_cores``), shared among the ranks of this node."""
    return max(1, usable_cores() // max(1, local_world_size))


def worker_cpus(gpu_path: bool, local_world_size: int = 1) -> set[int] | None:
    """The CPUs the workers run on: on the GPU path all but ``KEPT_CORES`` physical cores per rank of this
    node (``cores.worker_cpus``); None (this process's whole mask) on the CPU path, where the workers are
    the whole pipeline."""
    return _cpus_without(KEPT_CORES * max(1, local_world_size)) if gpu_path else None


class Candidate(NamedTuple):
    """A GPU-decodable sample as the share rule sees it: its file's bytes, its image height, its crop box."""

    nbytes: int
    height: int
    box: "CropBox"


def cpu_cost(c: Candidate) -> float:
    """The cropped CPU decode's cost, in byte-like units: the entropy-coded bytes down to the crop's last
    row (rows above are entropy-decoded too, rows below never) plus half the crop's pixels (IDCT, colour,
    resize). Against the cropped decoder's measured time on ImageNet-like files: r = 0.98."""
    return c.nbytes * (c.box.y + c.box.height) / c.height + 0.5 * c.box.width * c.box.height


def engine_cost(c: Candidate) -> float:
    """The NVJPG engines' cost in the same units: the file's bytes plus a per-image part
    (``ENGINE_BYTES_PER_IMAGE``); the box does not matter to them."""
    return c.nbytes + ENGINE_BYTES_PER_IMAGE


def cheapest_on_cpu(samples: Mapping[int, Candidate], quota: int) -> set[int]:
    """The keys of the ``quota`` samples of a chunk that the CPU decodes: those with the lowest CPU cost per
    engine cost, so the CPU takes what costs it least for what it saves the engines and neither side is left
    the other's expensive files (BENCHMARKS.md#which-samples-the-cpu-takes)."""
    ranked = sorted(samples, key=lambda k: cpu_cost(samples[k]) / engine_cost(samples[k]))
    return set(ranked[: max(0, quota)])


class ShareControl:
    """The CPU workers' share of each GPU-path batch: fixed, or adapted ("auto").

    "auto" puts on the workers as much as keeps the training fed, since a JPEG the CPU decodes costs the
    training's GPU least (an engine decode takes its streaming multiprocessors 9-13 us; BENCHMARKS.md, "What the
    loader's GPU work costs the training"). At the end of every ``IdleCores.WINDOW_S`` window of batches: when
    the training took every batch of the window ready (it never waited for the loader), the share goes up one
    step, whatever the workers' load, where cores are kept from the workers for the training process
    (``training_cores_kept``: ``worker_cpus`` restricts them; below 8 cores the workers share the training's
    cores, so the load rules alone decide). Otherwise the loader sets the pace, and the workers get what they
    keep up with while a quarter of the cores (``reserve``) stay idle for the training process: the share goes
    down one step per core missing from the reserve (at most ``MAX_DOWN_STEPS``), or one step if most batches
    were late (the workers finished them more than ``LATE_S`` after the GPU stage asked, by their own clock: the
    interpreter lock's delays in the training process are not the workers'); otherwise up one step when a core
    more than the reserve stayed idle, so that the CPU takes a part beside the GPU decoders without crowding out
    the threads that feed them. Up stays one step, since while the workers start and at epoch boundaries cores
    idle with no batch to decode (BENCHMARKS.md#cpu-share). A change reaches the batches submitted from then on.
    """

    STEP, LATE_S, MAX_DOWN_STEPS, START = 1 / 32, 0.002, 4, 0.5

    def __init__(self, setting: float | str, idle: IdleCores | None = None, *,
                 training_cores_kept: bool = True) -> None:
        self.check(setting)
        self.auto = setting == "auto"
        self.value = self.START if self.auto else float(setting)
        self._idle = (idle or IdleCores()) if self.auto else None
        self.reserve = max(1.0, self._idle.capacity / 4) if self._idle is not None else 0.0
        self._training_cores_kept = training_cores_kept
        self._batches = self._late = 0
        self._takes, self._lock = [0, 0], threading.Lock()  # the window's (taken, waited): the training's thread

    @staticmethod
    def check(setting: object) -> None:
        if not (setting == "auto" or (isinstance(setting, (int, float)) and 0 <= setting <= 1)):
            raise ValueError(f"cpu_share must be 'auto' or a fraction in [0, 1], got {setting!r}")

    def taken(self, waited: bool) -> None:
        """The training took a batch (its thread, ``Prefetcher``'s ``on_take``); ``waited``: none was ready."""
        if self._idle is None:  # a fixed share
            return
        with self._lock:
            self._takes[0] += 1
            self._takes[1] += waited

    def update(self, collect_wait: float) -> None:
        """After each GPU-path batch: ``collect_wait`` seconds from asking for it to the workers finishing it
        (``WorkerPool.collect``)."""
        if self._idle is None:
            return
        self._batches += 1
        self._late += collect_wait > self.LATE_S
        idle = self._idle.poll()
        if idle is None:
            return
        with self._lock:  # the window's takes, read and restarted at once
            (taken, waited), self._takes = self._takes, [0, 0]
        if self._training_cores_kept and taken and not waited:  # the loader is ahead: the CPU costs the GPU least
            self.value = min(1.0, self.value + self.STEP)
        elif idle < self.reserve:  # the workers crowd the cores the training process needs
            steps = min(self.MAX_DOWN_STEPS, max(1, round(self.reserve - idle)))
            self.value = max(0.0, self.value - steps * self.STEP)
        elif 2 * self._late > self._batches:  # they do not keep up
            self.value = max(0.0, self.value - self.STEP)
        elif idle >= self.reserve + 1:
            self.value = min(1.0, self.value + self.STEP)
        self._batches = self._late = 0
