"""What every decoder shares: the error type, format sniffing, the pixel cap, the skip log; and the
protocol of the GPU decoders (``GpuDecoder``) with the job they are given (``DecodeJob``)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_PIXELS = 100_000_000  # 100 MP: far above real photos, far below a header bomb


class DecodeError(ValueError):
    """An image that could not be decoded; ``path`` names the file."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot decode {path!r}: {reason}")
        self.path = path
        self.reason = reason


def is_jpeg(data: bytes | memoryview) -> bool:
    """True when ``data`` starts with a JPEG SOI marker (by content, not by file name)."""
    return bytes(data[:3]) == b"\xff\xd8\xff"


def check_pixels(width: int, height: int, max_pixels: int, path: str) -> None:
    """Reject a header whose size is empty or over ``max_pixels`` before anything is allocated."""
    if width < 1 or height < 1:
        raise DecodeError(path, f"header gives an empty size {width}x{height}")
    if width * height > max_pixels:
        raise DecodeError(path, f"{width}x{height} is {width * height} pixels, over max_pixels={max_pixels}")


class SkipLog:
    """What ``on_error="skip"`` dropped: a count in all, a count for the current epoch, and (path, reason) of
    the first ``LISTED``; and how many samples stood in for them (``repeated``). Shared by the stages that
    skip (the scheduler, the GPU stage); refers to nothing."""

    LISTED = 10_000

    def __init__(self) -> None:
        self.total = self.epoch = self.repeated = 0
        self.listed: list[tuple[str | None, str]] = []

    def record(self, path: str | None, reason: str) -> None:
        self.total += 1
        self.epoch += 1
        if len(self.listed) < self.LISTED:
            self.listed.append((path, reason))


def stand_ins(n: int, bad: Iterable[int]) -> dict[int, int]:
    """Under ``on_error="skip"``, for each position of a batch of ``n`` that could not be loaded, the position
    whose sample takes its place: the batch's good samples in order, cycling. The batch keeps its size and
    its entries of the epoch's order, so every rank yields the same number of full batches whatever it
    skips (DDP ranks must: the one with more would wait forever in its next all-reduce), and the position
    in the epoch stays the same on every rank (``sampling``: elastic resume). As DistributedSampler pads an
    epoch by repeating samples, a few samples are seen twice; ``loader.stats["repeated"]`` counts them.
    Empty when no position of the batch is good."""
    bad = sorted(set(bad))
    gone = set(bad)
    good = [k for k in range(n) if k not in gone]
    return {p: good[j % len(good)] for j, p in enumerate(bad)} if good else {}


@dataclass(frozen=True)
class DecodeJob:
    """JPEGs to decode into places of one buffer, given by address (no Python object per image): image j's
    bytes are ``lengths[j]`` bytes at host address ``src[j]`` (read in the CUDA stream's order), decoded as
    (heights[j], widths[j], 3) uint8 RGB at address ``dst[j]`` of ``device``'s memory. ``keep`` holds the
    memory those addresses point into alive for as long as the job."""

    src: np.ndarray  # (n,) uint64
    lengths: np.ndarray  # (n,) uint64
    dst: np.ndarray  # (n,) uint64
    heights: np.ndarray  # (n,) int64
    widths: np.ndarray  # (n,) int64
    device: "torch.device"
    keep: tuple = ()

    @classmethod
    def of(cls, datas: Sequence[np.ndarray], outs: Sequence["torch.Tensor"]) -> "DecodeJob":
        """A job from encoded ``datas`` (uint8 arrays) and their places ``outs`` ((h, w, 3) uint8 tensors,
        contiguous, on one device)."""
        datas = [np.ascontiguousarray(d, dtype=np.uint8) for d in datas]
        return cls(np.array([d.ctypes.data for d in datas], np.uint64), np.array([d.nbytes for d in datas], np.uint64),
                   np.array([o.data_ptr() for o in outs], np.uint64), np.array([o.shape[0] for o in outs], np.int64),
                   np.array([o.shape[1] for o in outs], np.int64), outs[0].device if len(outs) else None,
                   (datas, list(outs)))

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, part: slice | np.ndarray) -> "DecodeJob":
        return DecodeJob(self.src[part], self.lengths[part], self.dst[part], self.heights[part], self.widths[part],
                         self.device, self.keep)

    def source(self, j: int) -> np.ndarray:
        """Image j's encoded bytes, a uint8 view (no copy)."""
        n = int(self.lengths[j])
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(int(self.src[j]))) if n else np.empty(0, np.uint8)

    def device_view(self, j: int) -> "DeviceView":
        """Image j's place, as an object with ``__cuda_array_interface__``."""
        return DeviceView(int(self.dst[j]), int(self.heights[j]), int(self.widths[j]))

    def target(self, j: int) -> "torch.Tensor":
        """Image j's place, an (h, w, 3) uint8 tensor viewing the buffer (no copy)."""
        import torch

        h, w = int(self.heights[j]), int(self.widths[j])
        if self.device.type == "cuda":
            return torch.as_tensor(self.device_view(j), device=self.device)
        host = np.ctypeslib.as_array((ctypes.c_uint8 * (h * w * 3)).from_address(int(self.dst[j])))
        return torch.from_numpy(host.reshape(h, w, 3))


class DeviceView:
    """What a CUDA library needs to write into (h, w, 3) uint8 device memory: ``__cuda_array_interface__``.
    Built directly, it costs a fraction of the one torch builds per tensor, which matters 256 times a batch.
    It does not keep the memory alive (the job does)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, height: int, width: int) -> None:
        self.__cuda_array_interface__ = {"shape": (height, width, 3), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def engines_after(stream: Any) -> None:
    """Wait asleep on the host until the work queued so far on ``stream`` (a ``torch.cuda.Stream``) has run.

    nvJPEG's hardware decode (``nvjpegDecodeBatched``, called directly or through nvImageCodec) writes its
    output when it is called, not in the stream's order: a pending ``cudaStreamWaitEvent`` on the stream
    does not hold it back (reproduced on H100 with nvJPEG 12.3 to 13.2, meta-pytorch/torchcodec#1634). A
    decoder that writes into memory the stream's earlier work still reads (the GPU stage's decode buffer,
    read by the previous batch's kernel) calls this first."""
    import torch

    queued = torch.cuda.Event(blocking=True)
    queued.record(stream)
    queued.synchronize()


class GpuDecoder(Protocol):
    """A GPU decoder, created once per loader on one device and called from one thread at a time."""

    name: str  # as ``loader.stats["decoded_by"]`` reports it: "gpu:<name>"
    job_images: int  # images per decode call the GPU stage hands it (about; at least one call per decoder)

    def decode(self, job: DecodeJob, stream: Any) -> np.ndarray:
        """Decode ``job`` in ``stream``'s order (a ``torch.cuda.Stream``): nothing is written before the work
        queued on it so far has run (``engines_after``). (n,) bool: which were decoded. The places of the
        others hold nothing meaningful."""
        ...
