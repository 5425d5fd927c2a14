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
    text = list_file.read_text()
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
