"""ImageLoader's settings in groups, each frozen and validated when made, and nowhere else (errors name the
bad value).

``AugmentSpec`` (augment/params.py) says how samples become squares; ``Normalize`` (augment/normalize.py)
what the delivered tensors look like; the groups here say in what order and batches samples come
(``OrderOptions``), how they are decoded (``DecodeOptions``) and what happens to bad input and slow waits
(``ErrorPolicy``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .decode.base import DEFAULT_MAX_PIXELS
from .placement import DECODE_CHOICES, ShareControl

OnError = Literal["raise", "skip"]
ON_ERROR: tuple[OnError, ...] = ("raise", "skip")
# Deadlines and caps that hold by default, so no wait of the loader's is without an end (docs/security.md).
# Five minutes: hundreds of times a real sample's read and decode (a shard fetched whole included), and
# under torch.distributed's default 10-minute collective timeout, so the rank that is stuck names the file
# before the other ranks time out naming nothing.
DEFAULT_SAMPLE_TIMEOUT = 300.0
DEFAULT_BATCH_TIMEOUT = 600.0  # a batch whose samples each keep under sample_timeout still ends
DEFAULT_MAX_BYTES = 256 << 20  # far above any real image file; a 3 GB ".jpg" is refused unread
# An outage under on_error="skip" (the storage is gone, not a few files bad) raises: more than this share of
# the rank's epoch failed, or this many batches in a row had no sample that loaded.
OUTAGE_FRACTION = 0.5
OUTAGE_BATCHES = 10


@dataclass(frozen=True)
class OrderOptions:
    """The batches and their order: ``batch_size`` samples a batch on each rank; ``drop_last`` drops the
    ragged tail, across ranks and in the last batch; ``seed`` with the epoch gives the order; ``rank`` and
    ``world_size`` (None: from torch.distributed or torchrun's environment) the shard."""

    batch_size: int = 256
    drop_last: bool = True
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        if not is_integer(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not is_integer(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


@dataclass(frozen=True)
class DecodeOptions:
    """Where and by how many processes samples are decoded.

    ``decode``: one of ``placement.DECODE_CHOICES``; ``cpu_share``: "auto" or the fixed fraction of each
    GPU-path batch the CPU workers decode; ``num_workers``: worker processes (None: this process's usable
    cores shared among the node's ranks); ``prefetch_depth``: batches on the device ahead of the consumer;
    ``exif_orientation``: apply EXIF rotation before cropping; ``max_gpu_memory``: bytes of GPU memory the
    loader may hold (None: sized from the batch, ``placement.gpu_memory``).
    """

    decode: str = "auto"
    cpu_share: float | str = "auto"
    num_workers: int | None = None
    prefetch_depth: int = 2
    exif_orientation: bool = False
    max_gpu_memory: int | None = None

    def __post_init__(self) -> None:
        if self.decode not in DECODE_CHOICES:
            raise ValueError(f"decode must be one of {DECODE_CHOICES}, got {self.decode!r}")
        ShareControl.check(self.cpu_share)
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or self.num_workers < 1):
            raise ValueError(f"num_workers must be >= 1 or None, got {self.num_workers}")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be an integer >= 1, got {self.prefetch_depth!r}")
        if self.max_gpu_memory is not None and (not isinstance(self.max_gpu_memory, int) or self.max_gpu_memory < 1):
            raise ValueError(f"max_gpu_memory must be a number of bytes >= 1 or None, got {self.max_gpu_memory!r}")


@dataclass(frozen=True)
class ErrorPolicy:
    """What happens to input that cannot be loaded, and how long anything may take.

    ``on_error``: "raise" stops at the first bad file with an error naming it; "skip" drops it, records it
    in ``loader.stats`` and goes on, unless the failures are an outage (``is_outage``), which raises naming
    the first ones. ``max_pixels``: images whose header claims more are refused before anything is
    allocated. ``max_bytes``: files larger are refused before they are read. ``num_classes``: labels must lie
    in [0, num_classes) (None: any integer >= 0). ``sample_timeout``: seconds one sample's read and decode
    may take before its worker is replaced; ``batch_timeout``: seconds a batch may take in all before the
    loader raises, naming the workers and the samples in flight (None: no limit, for either).
    ``verify_checksums``: check each shard against the sha256 its ``gpufeed shards`` manifest lists, hashed at most
    once per loader on each machine (``sources.checksums``); a changed shard fails its samples, naming it.
    """

    on_error: OnError = "raise"
    max_pixels: int = DEFAULT_MAX_PIXELS
    sample_timeout: float | None = DEFAULT_SAMPLE_TIMEOUT
    max_bytes: int = DEFAULT_MAX_BYTES
    batch_timeout: float | None = DEFAULT_BATCH_TIMEOUT
    num_classes: int | None = None
    verify_checksums: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.verify_checksums, bool):
            raise ValueError(f"verify_checksums must be True or False, got {self.verify_checksums!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        for name in ("max_pixels", "max_bytes"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_classes is not None and (not is_integer(self.num_classes) or self.num_classes < 1):
            raise ValueError(f"num_classes must be an integer >= 1 or None, got {self.num_classes!r}")
        for name in ("sample_timeout", "batch_timeout"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be > 0 seconds or None, got {value!r}")

    @property
    def skips(self) -> bool:
        """Whether a bad sample is skipped (recorded, and another of its batch stands in) rather than raised."""
        return self.on_error == "skip"


def is_outage(failed: int, of: int, failed_batches: int) -> bool:
    """Whether ``failed`` of the ``of`` samples of a rank's epoch (so far), the last ``failed_batches``
    batches in a row with no sample loaded, are an outage rather than bad files (``OUTAGE_FRACTION``,
    ``OUTAGE_BATCHES``)."""
    return failed > OUTAGE_FRACTION * of or failed_batches >= OUTAGE_BATCHES


def is_integer(value: object) -> bool:
    """An int and not a bool (which Python counts as one): how every count, size and seed is checked."""
    return isinstance(value, int) and not isinstance(value, bool)
