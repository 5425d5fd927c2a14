"""ImageLoader's settings in groups, each frozen and validated when made (errors name the bad value).

``AugmentSpec`` (augment/params.py) says how samples become squares; ``Normalize`` (augment/normalize.py)
what the delivered tensors look like; the groups here say how samples are decoded and what happens to
bad input.
"""

from __future__ import annotations

from dataclasses import dataclass

from .decode.base import DEFAULT_MAX_PIXELS
from .placement import DECODE_CHOICES, ShareControl

ON_ERROR = ("raise", "skip")


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
    """What happens to input that cannot be loaded.

    ``on_error``: "raise" stops at the first bad file with an error naming it; "skip" drops it, records it
    in ``loader.stats`` and goes on. ``max_pixels``: images whose header claims more are refused before
    anything is allocated. ``sample_timeout``: seconds one sample's decode may take before its worker is
    replaced (None: no limit).
    """

    on_error: str = "raise"
    max_pixels: int = DEFAULT_MAX_PIXELS
    sample_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise ValueError(f"max_pixels must be an integer >= 1, got {self.max_pixels!r}")
        if self.sample_timeout is not None and self.sample_timeout <= 0:
            raise ValueError(f"sample_timeout must be > 0 seconds or None, got {self.sample_timeout}")
