"""A text or CSV file of ``path,label`` lines."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from .base import FileSource, parse_label


def filelist_source(list_file: str | os.PathLike, *, root: str | os.PathLike | None = None) -> FileSource:
    """Read ``path,label`` lines (comma, tab or space separated; ``#`` comments).

    Relative paths are taken from ``root``, by default the list file's folder. A header line
    ``path,label`` is skipped. Raises ``ValueError`` naming the line for a malformed row or a label that is
    not an integer in [0, 2**63), and ``FileNotFoundError`` naming the first file that does not exist,
    before any loading starts.
    """
    list_file = Path(list_file)
    if not list_file.is_file():
        raise FileNotFoundError(f"file list {str(list_file)!r} does not exist")
    base = Path(root) if root is not None else list_file.parent
    text = _text(list_file)
    dialect = "excel-tab" if "\t" in text.split("\n", 1)[0] else "excel"
    paths: list[str] = []
    labels: list[int] = []
    for lineno, row in enumerate(csv.reader(text.splitlines(), dialect=dialect), start=1):
        if len(row) == 1 and " " in row[0].strip():
            row = row[0].split()
        row = [c.strip() for c in row]
        if not row or not row[0] or row[0].startswith("#"):
            continue
        if lineno == 1 and row[:2] == ["path", "label"]:
            continue
        if len(row) < 2:
            raise ValueError(f"{list_file}:{lineno}: expected 'path,label', got {','.join(row)!r}")
        label = parse_label(row[1], f"{list_file}:{lineno}")
        p = Path(row[0])
        paths.append(str(p if p.is_absolute() else base / p))
        labels.append(label)
    if not paths:
        raise ValueError(f"file list {str(list_file)!r} names no files")
    missing = next((p for p in paths if not os.path.exists(p)), None)
    if missing is not None:
        raise FileNotFoundError(f"file list {str(list_file)!r} names a missing file: {missing!r}")
    return FileSource(paths=paths, labels=labels)


# the first bytes of the image formats a path to one image would hold, which is no list
_IMAGE_MAGIC = {b"\xff\xd8\xff": "a JPEG", b"\x89PNG": "a PNG", b"GIF8": "a GIF", b"RIFF": "a WebP", b"BM": "a BMP"}
_SOURCES = ("a folder of class folders, a file list of 'path,label' lines, a .tar shard, a .parquet file or a "
            "URL of them")


def _text(list_file: Path) -> str:
    """The list's text; a file that is not UTF-8 text (an image, a binary) raises naming it and what is taken."""
    data = list_file.read_bytes()
    kind = next((k for magic, k in _IMAGE_MAGIC.items() if data.startswith(magic)), None)
    if kind is not None:
        raise ValueError(f"{str(list_file)!r} is {kind} image, not a data set: give {_SOURCES}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{str(list_file)!r} is not a text file list (byte {e.start} is not UTF-8): give "
                         f"{_SOURCES}") from None
