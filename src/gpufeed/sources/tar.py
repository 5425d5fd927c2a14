"""Tar shards: images read in place from one .tar or a folder of .tar files.

Members are indexed once (name, offset, size); reading a sample is one
``os.pread`` at its offset, so shards are never unpacked. Labels come from a
WebDataset-style ``<key>.cls`` member when a sample has one, else from the
member's folder inside the tar, ImageFolder style (classes sorted by name over
all shards). A ``.cls`` that does not hold an integer >= 0 fails its own sample only, naming the shard and
member, when that sample is loaded.
"""

from __future__ import annotations

import os
import tarfile
import warnings
from pathlib import Path

import numpy as np

from .checksums import ShardChecksums
from .base import IMG_EXTENSIONS, LABEL_TEXT_MAX, digest, parse_label, refuse_over, relative

CLS_BYTES = LABEL_TEXT_MAX  # a .cls member holds a number: a longer one is not read
LEFT_OUT = "a tar's links, devices and FIFOs are never read, only its regular files"  # why, in loader.stats


class TarSource:
    """Samples stored in tar shards; picklable (file handles are opened lazily in each process)."""

    def __init__(self, shards: list[str], shard: np.ndarray, offset: np.ndarray, size: np.ndarray,
                 labels: np.ndarray, names: list[str], classes: list[str], bad: dict[int, str] | None = None) -> None:
        self.shards, self.classes = shards, classes
        self._shard, self._offset, self._size, self._labels, self._names = shard, offset, size, labels, names
        self._bad = bad or {}  # sample -> why its label cannot be used
        self._fds: dict[int, int] = {}
        self.left_out: list[tuple[str, str]] = []  # (shard:member, why) of members named like images never read
        self.checksums: ShardChecksums | None = None  # set: each shard checked on its first read here

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fds"] = {}
        return state

    def __len__(self) -> int:
        return len(self._offset)

    def path(self, index: int) -> str:
        return f"{self.shards[self._shard[index]]}:{self._names[index]}"

    def label(self, index: int) -> int:
        label = int(self._labels[index])
        if label < 0:  # a .cls that holds no label (``_bad`` says why)
            raise ValueError(self._bad[index])
        return label

    def read(self, index: int, max_bytes: int | None = None) -> bytes:
        size = int(self._size[index])
        refuse_over(size, max_bytes, self.path(index))
        s = int(self._shard[index])
        fd = self._fds.get(s)
        if fd is None:
            fd = os.open(self.shards[s], os.O_RDONLY)
            if self.checksums is not None:
                try:
                    self.checksums.check(self.shards[s], fd)
                except OSError:
                    os.close(fd)
                    raise
            self._fds[s] = fd  # held only once it passed: a changed shard is opened, and refused, each time
        data = os.pread(fd, size, int(self._offset[index]))
        if len(data) != size:
            raise OSError(f"{self.path(index)}: read {len(data)} of {size} bytes (shard truncated?)")
        return data

    def digest(self) -> str:
        """The shards (``base.relative``), member names and labels, hashed (``base.fingerprint``)."""
        return digest("tar", relative(self.shards), self._names, self._shard, self._labels)

    def __del__(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass


def tar_source(path: str | os.PathLike, *, extensions: tuple[str, ...] = IMG_EXTENSIONS) -> TarSource:
    """Index ``path`` (a .tar file, or a folder whose .tar files are the shards, in sorted order)."""
    path = Path(path)
    shards = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix == ".tar")
    if not shards:
        raise ValueError(f"no .tar shards in {str(path)!r}")
    images: list[tuple[int, int, int, str]] = []  # shard, offset, size, member name
    cls_of: dict[tuple[int, str], int | str] = {}  # a label, or why the .cls holds none
    not_files: list[str] = []  # image names of links, devices, FIFOs: never read
    for s, shard in enumerate(shards):
        try:
            with tarfile.open(shard, "r:") as tf:
                for m in tf:
                    if not m.isfile():
                        if m.name.lower().endswith(extensions) and not m.isdir():
                            not_files.append(f"{shard}:{m.name}")
                        continue
                    name = m.name
                    if name.lower().endswith(extensions):
                        images.append((s, m.offset_data, m.size, name))
                    elif name.endswith(".cls"):
                        cls_of[(s, name[: -len(".cls")])] = cls_label(tf.extractfile(m).read(CLS_BYTES + 1),
                                                                      f"{shard}:{name}")
        except tarfile.TarError as e:
            raise ValueError(f"cannot read tar shard {str(shard)!r}: {e}") from None
    if not_files:
        warnings.warn(f"{len(not_files)} members of {str(path)!r} with image names are left out: {LEFT_OUT} "
                      f"(first: {not_files[0]!r}); loader.stats['left_out'] lists them", stacklevel=2)
    if not images:
        raise ValueError(f"no images with an extension in {extensions} in {str(path)!r}")
    folders = sorted({os.path.dirname(n) for _, _, _, n in images})
    folder_label = {f: i for i, f in enumerate(folders)}
    found: list[int | str] = []
    for s, _, _, name in images:
        key = os.path.splitext(name)[0]
        if (s, key) in cls_of:
            found.append(cls_of[(s, key)])
        elif os.path.dirname(name):
            found.append(folder_label[os.path.dirname(name)])
        else:
            raise ValueError(f"{shards[s]}:{name}: no '{key}.cls' member and no class folder to take a label from")
    labels, bad = split_labels(found)
    source = TarSource(
        [str(p) for p in shards],
        np.array([i[0] for i in images], np.int32),
        np.array([i[1] for i in images], np.int64),
        np.array([i[2] for i in images], np.int64),
        np.array(labels, np.int64),
        [i[3] for i in images],
        folders if not cls_of else [],
        bad,
    )
    source.left_out = [(name, LEFT_OUT) for name in not_files]
    return source


def cls_label(text: bytes, where: str) -> int | str:
    """The label a ``.cls`` member's bytes hold (at most ``CLS_BYTES``), or, when they hold none, why
    (naming ``where``, the shard and member)."""
    try:
        return parse_label(text, where)
    except ValueError as e:
        return str(e)


def split_labels(found: list[int | str]) -> tuple[list[int], dict[int, str]]:
    """Labels as ``cls_label`` gave them: (labels, -1 where there is none; position -> why)."""
    labels, bad = [], {}
    for k, label in enumerate(found):
        if isinstance(label, str):
            bad[k], label = label, -1
        labels.append(label)
    return labels, bad
