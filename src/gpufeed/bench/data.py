"""The check of ``gpufeed bench --data`` before anything starts: the path exists, can be read, and holds an
image the loader opens. Imports neither torch nor the loader, so that a wrong path fails in a fraction of a
second, not after the pipelines' processes have started."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

EXPECTED = ("an ImageFolder folder (DATA/<class>/<image>), tar shards, Parquet files, a 'path,label' file list, "
            "or a URL of shards or Parquet files")


@dataclass(frozen=True)
class DataSummary:
    """What ``--data`` holds: its samples and, for an ImageFolder folder, its classes (0 when not counted)."""

    images: int
    classes: int
    first_checked: bool  # whether the first image was read and decoded (local data only)

    def describe(self) -> str:
        text = f"{self.images:,} images" + (f" in {self.classes:,} classes" if self.classes else "")
        return text + ("" if self.first_checked else " (listed, none read yet)")


def check_data(data: str, storage_options: dict[str, Any] | None = None) -> DataSummary:
    """``data`` opened as the loader opens it, and, where local, its first image read and decoded on the CPU;
    else a ValueError naming ``data`` and what was expected. A URL's samples are listed only: reading one
    fetches its whole shard, which the pipelines fetch again."""
    remote, where, path = False, data, data
    if "://" in data:  # a plain path is checked before the sources (and numpy) are imported
        from ..sources.urls import redact, scheme

        kind = scheme(data)
        remote = kind is not None and not (kind == "file" and "{" not in data)  # file:// without braces: a path
        where, path = redact(data), data[len("file://"):] if kind == "file" else data
    if not remote:
        if not os.path.exists(path):
            raise ValueError(f"--data {where}: no such file or folder; expected {EXPECTED}")
        if not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
            raise ValueError(f"--data {where}: cannot be read (permission denied); expected {EXPECTED}")
    from ..sources import create_source

    try:  # the sources' errors name the file and what they expected of it
        source = create_source(data, storage_options=storage_options)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data {where}: {_reason(e)}") from None
    if len(source) == 0:
        raise ValueError(f"--data {where}: holds no image; expected {EXPECTED}")
    classes = len(getattr(source, "classes", ()) or ())
    if remote:
        return DataSummary(len(source), classes, first_checked=False)
    _open_first(source, where)
    return DataSummary(len(source), classes, first_checked=True)


def _open_first(source: Any, where: str) -> None:
    """Read and decode the first sample as the loader's CPU workers do; a ValueError naming it otherwise."""
    from ..decode import CpuDecoder
    from ..options import DEFAULT_MAX_BYTES
    from ..sources.base import read_capped

    first = source.path(0)
    try:
        data = read_capped(source, 0, DEFAULT_MAX_BYTES)
        decoder = CpuDecoder()
        _, _, fast = decoder.header(data, first)
        decoder.decode(data, first, fast=fast)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data {where}: its first image does not open: {_reason(e)}") from None


def _reason(e: Exception) -> str:
    return str(e) or type(e).__name__
