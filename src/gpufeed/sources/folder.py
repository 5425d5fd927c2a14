"""ImageFolder layout: ``root/<class>/<image>``, labels by sorted class name."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .base import IMG_EXTENSIONS, FileSource

_log = logging.getLogger("gpufeed")


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
    try:
        info = os.stat(top)
    except OSError:
        return []
    if (info.st_dev, info.st_ino) in seen:
        _log.warning("gpufeed: %r leads to a folder already listed (%r), a second name for it; skipped, so "
                     "each image is listed once", top, os.path.realpath(top))
        return []
    seen.add((info.st_dev, info.st_ino))
    found = []
    for dirpath, dirnames, files in os.walk(top, followlinks=True):
        found.append((dirpath, files))
        keep = []
        for d in sorted(dirnames):  # sorted: the same name claims a folder reached twice, every time
            try:
                sub = os.stat(os.path.join(dirpath, d))
            except OSError:  # a dangling link: nothing to list
                continue
            if (sub.st_dev, sub.st_ino) in seen:
                link = os.path.join(dirpath, d)
                _log.warning("gpufeed: %r leads to a folder already listed (%r), a loop or a second name for it; "
                             "skipped, so each image is listed once", link, os.path.realpath(link))
                continue
            seen.add((sub.st_dev, sub.st_ino))
            keep.append(d)
        dirnames[:] = keep
    return sorted(found)
