"""What a conversion is asked for, validated when made (errors name the bad value)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..cores import affinity
from ..options import DEFAULT_MAX_BYTES

FORMATS = ("tar", "parquet")
ENGINES = ("local", "ray")
ON_ERROR = ("skip", "raise")
DEFAULT_QUALITY = 90  # FFCV's default JPEG quality for the images it re-encodes
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class ShardSize:
    """A shard's size: ``samples`` inputs, or about ``bytes`` bytes (one of the two)."""

    samples: int | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.samples is None) == (self.bytes is None):
            raise ValueError(f"a shard size is samples or bytes, got samples={self.samples!r}, bytes={self.bytes!r}")
        value = self.samples if self.samples is not None else self.bytes
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"a shard size must be an integer >= 1, got {value!r}")

    @classmethod
    def parse(cls, text: str | int) -> "ShardSize":
        """``1000``: samples; ``256MB``, ``1GiB``, ``500kb``: bytes (KB, MB, GB powers of 1000; KiB, MiB,
        GiB of 1024)."""
        if isinstance(text, int):
            return cls(samples=text)
        m = _SIZE.match(str(text))
        unit = m and m.group(2).lower()
        if m is None or unit not in _UNITS:
            raise ValueError(f"shard size must be a sample count (1000) or bytes (256MB, 1GiB), got {text!r}")
        if not unit:
            if "." in m.group(1):
                raise ValueError(f"a shard size in samples must be a whole number, got {text!r}")
            return cls(samples=int(m.group(1)))
        return cls(bytes=int(float(m.group(1)) * _UNITS[unit]))

    def __str__(self) -> str:
        return str(self.samples) if self.samples is not None else f"{self.bytes}B"


@dataclass(frozen=True)
class ShardOptions:
    """How ``write_shards`` converts.

    ``format``: "tar" (WebDataset: ``<key>.jpg`` + ``<key>.cls``) or "parquet" (``image`` {bytes, path}
    struct + ``label``); ``max_side``: images whose longer side is over it are resized to it (aspect kept)
    and re-encoded as JPEG at ``quality``, the others copied byte for byte (None: every image copied);
    ``shard_size``: samples or bytes per shard; ``shuffle``: the seed of the sample order across shards,
    None for the source's order, "auto" for ``default_shuffle``; ``workers``: processes (local) or
    actors (Ray), None for this machine's usable cores or the cluster's CPUs; ``on_error``: "skip" an
    input that cannot be read or decoded (named in the manifest) or "raise" at the first; ``engine``:
    "local" (processes on this machine) or "ray" (a Ray Data job); ``max_bytes``: an input file larger than
    this is broken, refused unread (the loader's cap, ``ImageLoader(max_bytes=)``).
    """

    format: str = "tar"
    max_side: int | None = None
    quality: int = DEFAULT_QUALITY
    shard_size: ShardSize = ShardSize(bytes=256 * 10**6)
    shuffle: int | None | str = "auto"
    workers: int | None = None
    on_error: str = "skip"
    engine: str = "local"
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.max_side is not None and (not isinstance(self.max_side, int) or self.max_side < 1):
            raise ValueError(f"max_side must be an integer >= 1 or None, got {self.max_side!r}")
        if not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise ValueError(f"quality must be an integer from 1 to 100, got {self.quality!r}")
        if not isinstance(self.shard_size, ShardSize):
            raise ValueError(f"shard_size must be a ShardSize, got {self.shard_size!r}")
        if self.shuffle != "auto" and self.shuffle is not None and (
                not isinstance(self.shuffle, int) or isinstance(self.shuffle, bool) or self.shuffle < 0):
            raise ValueError(f"shuffle must be a seed (an integer >= 0), None or 'auto', got {self.shuffle!r}")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            raise ValueError(f"workers must be an integer >= 1 or None, got {self.workers!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes < 1:
            raise ValueError(f"max_bytes must be an integer >= 1, got {self.max_bytes!r}")


def default_shuffle(source: object) -> int | None:
    """The order when none is asked for: shuffled (seed 0) for sources read in place, so that a shard
    holds all classes and the loader's shard-by-shard order for shards read whole still mixes them; the
    source's own order for sources read whole group by group (remote shards, Parquet row groups), where a
    shuffle would fetch each of their files once for every output shard that draws from it."""
    return None if getattr(source, "groups", None) is not None else 0


def default_workers() -> int:
    return len(affinity())
