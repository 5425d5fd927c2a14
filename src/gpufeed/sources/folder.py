"""ImageFolder layout: ``root/<class>/<image>``, labels by sorted class name."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .base import IMG_EXTENSIONS, FileSource

_log = logging.getLogger("gpufeed")
_SPLITS = {"train", "training", "val", "valid", "validation", "test", "testing"}


def folder_source(root: str | os.PathLike, *, extensions: tuple[str, ...] = IMG_EXTENSIONS) -> FileSource:
    """List ``root`` the way ``torchvision.datasets.ImageFolder`` does.

    Classes are the sub-folders of ``root`` in sorted order; files are taken
    when their lower-cased name ends with one of ``extensions`` (others are
    ignored, as ImageFolder ignores them). Symbolic links are followed, but each real directory (device,
    inode) is listed once: a link to a folder already listed (a loop, or the same folder under two names)
    is skipped and logged as a warning naming the link and where it leads. Raises ``FileNotFoundError`` /
    ``ValueError`` naming the folder when it is missing, has no class folders, or a class folder holds no
    image.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"dataset folder {str(root)!r} does not exist or is not a directory")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"dataset folder {str(root)!r} has no class sub-folders (expected root/<class>/<image>)")
    splits = [c for c in classes if c.lower() in _SPLITS]
    if len(splits) >= 2:  # a data set's parent: its splits would be learned as classes
        _log.warning("gpufeed: %r has the class folders %s, which name splits of a data set, not classes: give the "
                     "split's folder, e.g. %r", str(root), ", ".join(map(repr, classes)), str(root / splits[0]))
    paths: list[str] = []
    labels: list[int] = []
    seen: set[tuple[int, int]] = set()
    for label, name in enumerate(classes):
        found = 0
        for dirpath, files in _walk(str(root / name), seen):
            for fname in sorted(files):
                if fname.lower().endswith(extensions):
                    paths.append(os.path.join(dirpath, fname))
                    labels.append(label)
                    found += 1
        if not found:
            raise ValueError(
                f"class folder {str(root / name)!r} holds no image with an extension in {extensions}"
            )
    return FileSource(paths=paths, labels=labels, classes=classes)


def _walk(top: str, seen: set[tuple[int, int]]) -> list[tuple[str, list[str]]]:
    """(folder, file names) under ``top`` in ImageFolder's order (``sorted(os.walk(top, followlinks=True))``),
    each real directory once: one already in ``seen`` (by device and inode) is skipped and reported."""
    if not _claim(top, seen, "a second name for it"):
        return []
    found = []
    for dirpath, dirnames, files in os.walk(top, followlinks=True):
        found.append((dirpath, files))
        # sorted: the same name claims a folder reached twice, every time
        dirnames[:] = [d for d in sorted(dirnames)
                       if _claim(os.path.join(dirpath, d), seen, "a loop or a second name for it")]
    return sorted(found)


def _claim(folder: str, seen: set[tuple[int, int]], what: str) -> bool:
    """Whether ``folder`` is a real directory not yet in ``seen`` (which then holds it); one already listed
    is reported as ``what`` it is. A name that cannot be read (a dangling link) has nothing to list."""
    try:
        info = os.stat(folder)
    except OSError:
        return False
    if (info.st_dev, info.st_ino) in seen:
        _log.warning("gpufeed: %r leads to a folder already listed (%r), %s; skipped, so each image is listed once",
                     folder, os.path.realpath(folder), what)
        return False
    seen.add((info.st_dev, info.st_ino))
    return True
