"""ImageFolder layout: ``root/<class>/<image>``, labels by sorted class name."""

from __future__ import annotations

import os
from pathlib import Path

from .base import IMG_EXTENSIONS, FileSource


def folder_source(root: str | os.PathLike, *, extensions: tuple[str, ...] = IMG_EXTENSIONS) -> FileSource:
    """List ``root`` the way ``torchvision.datasets.ImageFolder`` does.

    Classes are the sub-folders of ``root`` in sorted order; files are taken
    when their lower-cased name ends with one of ``extensions`` (others are
    ignored, as ImageFolder ignores them). Symbolic links are followed.
    Raises ``FileNotFoundError`` / ``ValueError`` naming the folder when it is
    missing, has no class folders, or a class folder holds no image.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"dataset folder {str(root)!r} does not exist or is not a directory")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"dataset folder {str(root)!r} has no class sub-folders (expected root/<class>/<image>)")
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        found = 0
        for dirpath, _, files in sorted(os.walk(root / name, followlinks=True)):
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
