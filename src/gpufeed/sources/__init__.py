"""Sources: where bytes and labels come from, by sample index."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from .base import IMG_EXTENSIONS, FileSource, Source
from .fetch import FetchLimits
from .filelist import filelist_source
from .folder import folder_source
from .manifest import MANIFEST, manifest_source, refuse_unfinished
from .parquet import ParquetSource, parquet_source
from .remote_tar import RemoteTarSource, remote_tar_source
from .retry import ONCE, RetryPolicy, with_retries
from .tar import TarSource, tar_source
from .urls import filesystem, is_url, redact, scheme

__all__ = ["IMG_EXTENSIONS", "FetchLimits", "FileSource", "ParquetSource", "RemoteTarSource", "RetryPolicy", "Source",
           "TarSource", "create_source", "filelist_source", "folder_source", "parquet_source", "remote_tar_source",
           "tar_source"]


def create_source(source: "str | os.PathLike | Sequence[str] | Source", *,
                  storage_options: dict[str, Any] | None = None) -> Source:
    """A folder gives an ImageFolder source (or tar shards, or Parquet files, when it holds only those), a
    .tar file tar shards, a .parquet file a Parquet table, any other file a file list. A URL (s3://, gs://,
    az://, https://, ...; a brace range ``shard-{000..099}.tar``; a folder URL) or a list of URLs gives
    remote tar shards or Parquet files, opened with fsspec and ``storage_options``; ``file://`` URLs without
    a brace range are local paths. A Source passes through."""
    if isinstance(source, (list, tuple)):
        if not source or not all(isinstance(s, (str, os.PathLike)) for s in source):
            raise ValueError("a list source must be a non-empty list of URLs or paths")
        names = [str(s) for s in source]
        if all(n.endswith(".parquet") for n in names):
            return parquet_source(names, storage_options=storage_options)
        return remote_tar_source(names, storage_options=storage_options)
    if isinstance(source, str) and is_url(source):
        if scheme(source) == "file" and "{" not in source:
            return create_source(source[len("file://") :])
        return _url_source(source, storage_options)
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_file():
            if p.suffix == ".parquet":
                return parquet_source(p)
            return tar_source(p) if p.suffix == ".tar" else filelist_source(p)
        if p.is_dir():
            shards = manifest_source(p)  # shards gpufeed wrote: counted by their manifest
            if shards is not None:
                return shards
            refuse_unfinished(str(p))
            entries = folder_entries(p)
            if entries and all(e.is_file() and e.suffix == ".tar" for e in entries):
                return tar_source(p)
            if entries and all(e.is_file() and e.suffix == ".parquet" for e in entries):
                return parquet_source(p)
        return folder_source(p)
    if isinstance(source, Source):
        if len(source) == 0:
            raise ValueError("source is empty")
        return source
    raise TypeError(f"source must be a folder, a file list, a URL or a gpufeed Source, got {type(source).__name__}")


def folder_entries(folder: Path) -> list[Path]:
    """What a folder holds that names its kind (tar shards, Parquet files): all but hidden files and the
    shard manifest."""
    return [e for e in folder.iterdir() if not e.name.startswith(".") and e.name != MANIFEST]


def _url_source(url: str, storage_options: dict[str, Any] | None) -> Source:
    """Tar shards or Parquet files behind ``url``: by its suffix, or for a folder URL by what it holds."""
    if url.endswith(".parquet"):
        return parquet_source(url, storage_options=storage_options)
    if url.endswith(".tar") or "{" in url:
        return remote_tar_source(url, storage_options=storage_options)
    shards = manifest_source(url, storage_options)  # shards gpufeed wrote: no shard fetched to count it
    if shards is not None:
        return shards
    fs = filesystem(url, storage_options)
    names = with_retries(lambda: fs.find(url), url, ONCE, "list the folder")
    refuse_unfinished(url, storage_options, names)
    if any(n.endswith(".tar") for n in names):
        return remote_tar_source(url, storage_options=storage_options)
    if any(n.endswith(".parquet") for n in names):
        return parquet_source(url, storage_options=storage_options)
    raise ValueError(f"no .tar shards or .parquet files under {redact(url)!r}")
