"""Sources: where bytes and labels come from, by sample index."""

from __future__ import annotations

import os
from pathlib import Path

from .base import IMG_EXTENSIONS, FileSource, Source
from .filelist import filelist_source
from .folder import folder_source
from .tar import TarSource, tar_source

__all__ = ["IMG_EXTENSIONS", "FileSource", "Source", "TarSource", "create_source", "filelist_source", "folder_source",
           "tar_source"]


def create_source(source: "str | os.PathLike | Source") -> Source:
    """A folder gives an ImageFolder source (or tar shards, when it holds only .tar files), a .tar file
    tar shards, any other file a file list; a Source passes through."""
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_file():
            return tar_source(p) if p.suffix == ".tar" else filelist_source(p)
        if p.is_dir():
            entries = [e for e in p.iterdir() if not e.name.startswith(".")]
            if entries and all(e.is_file() and e.suffix == ".tar" for e in entries):
                return tar_source(p)
        return folder_source(p)
    if isinstance(source, Source):
        if len(source) == 0:
            raise ValueError("source is empty")
        return source
    raise TypeError(f"source must be a folder, a file list or a gpufeed Source, got {type(source).__name__}")
