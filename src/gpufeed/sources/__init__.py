"""Sources: where bytes and labels come from, by sample index."""

from __future__ import annotations

import os
from pathlib import Path

from .base import IMG_EXTENSIONS, FileSource, Source
from .filelist import filelist_source
from .folder import folder_source

__all__ = ["IMG_EXTENSIONS", "FileSource", "Source", "create_source", "filelist_source", "folder_source"]


def create_source(source: "str | os.PathLike | Source") -> Source:
    """A folder path gives an ImageFolder source, a file path a file list; a Source passes through."""
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_file():
            return filelist_source(p)
        return folder_source(p)
    if isinstance(source, Source):
        if len(source) == 0:
            raise ValueError("source is empty")
        return source
    raise TypeError(f"source must be a folder, a file list or a gpufeed Source, got {type(source).__name__}")
