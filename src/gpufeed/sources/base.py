"""The source protocol: where a sample's bytes and label come from, by index."""

from __future__ import annotations

import bisect
import errno
import functools
import hashlib
import inspect
import operator
import os
import stat
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

# The extensions torchvision's ImageFolder accepts (torchvision.datasets.folder.IMG_EXTENSIONS).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
LABEL_MAX = (1 << 63) - 1  # labels travel as int64
LABEL_TEXT_MAX = 64  # a label's text (a .cls member, a list's column): a longer one is not parsed, since
# int() of a huge digit string is slow
FILE_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
              stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


class TooLarge(OSError):
    """A file or a response over its byte cap, refused before it was read whole."""


def read_capped(source: "Source", index: int, max_bytes: int | None) -> bytes:
    """Sample ``index``'s bytes, refused (``TooLarge`` naming it) over ``max_bytes``: unread where the source's
    ``read`` takes ``max_bytes`` (gpufeed's own sources do), else once read (a source of the user's)."""
    if max_bytes is None:
        return source.read(index)
    data = source.read(index, max_bytes=max_bytes) if takes_max_bytes(source) else source.read(index)
    if len(data) > max_bytes:
        raise TooLarge(errno.EFBIG, f"{len(data)} bytes, over max_bytes={max_bytes}", source.path(index))
    return data


def takes_max_bytes(source: "Source") -> bool:
    """Whether ``source.read`` takes ``max_bytes``, so that it refuses a larger sample before reading it."""
    return _read_takes_max_bytes(type(source))


@functools.lru_cache(maxsize=None)
def _read_takes_max_bytes(kind: type) -> bool:
    try:
        return "max_bytes" in inspect.signature(kind.read).parameters
    except (TypeError, ValueError, AttributeError):  # a read no signature can be found for
        return False


def refuse_over(size: int, max_bytes: int | None, where: str) -> None:
    """``TooLarge`` naming ``where`` when a sample of ``size`` bytes is over ``max_bytes``, before it is read."""
    if max_bytes is not None and size > max_bytes:
        raise TooLarge(f"{where}: {size} bytes, over max_bytes={max_bytes}: refused unread")


def read_file(path: str, max_bytes: int | None = None) -> bytes:
    """A whole file's bytes. Plain os calls (open, fstat, read until the end): 13 us against 19-20 us for
    ``Path.read_bytes`` per ~100 KB file in the page cache, on the development machine. Only regular files:
    a FIFO or a device named like an image is refused at once (opened without waiting for a writer), never
    read; a file over ``max_bytes`` is refused before any byte is read (``TooLarge``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # no effect on a regular file; a FIFO opens at once
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = FILE_KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise OSError(errno.EINVAL, f"not a regular file ({kind})", path)
        if max_bytes is not None and info.st_size > max_bytes:
            raise TooLarge(errno.EFBIG, f"{info.st_size} bytes, over max_bytes={max_bytes}: refused unread", path)
        data = os.read(fd, info.st_size or 1 << 16)
        more = os.read(fd, 1 << 16) if data else b""
        if not more:  # the usual case: the size stat gave was the whole file, returned without a copy
            return data
        parts = [data, more]  # a file that grew, or one whose size stat does not give: read until the end
        total = len(data) + len(more)
        while parts[-1]:
            if max_bytes is not None and total > max_bytes:
                raise TooLarge(errno.EFBIG, f"over max_bytes={max_bytes} bytes (it grew while read)", path)
            parts.append(os.read(fd, 1 << 20))
            total += len(parts[-1])
        return b"".join(parts)
    finally:
        os.close(fd)


def check_label(value: Any, where: str, num_classes: int | None = None) -> int:
    """``value`` as a label: an integer in [0, ``num_classes``) (or [0, 2**63) without it); else a
    ValueError naming ``where`` (the file, member or row) and the value."""
    try:
        label = operator.index(value)
    except TypeError:
        raise ValueError(f"{where}: label must be an integer, got {value!r}") from None
    if label < 0:
        raise ValueError(f"{where}: label must be >= 0, got {label}")
    if num_classes is not None and label >= num_classes:
        raise ValueError(f"{where}: label {label} is not below num_classes={num_classes}")
    if label > LABEL_MAX:
        raise ValueError(f"{where}: label {label} does not fit in int64")
    return label


def parse_label(text: str | bytes, where: str) -> int:
    """The label a text holds (at most ``LABEL_TEXT_MAX`` characters, an optional sign and digits), checked
    as ``check_label`` checks it; else a ValueError naming ``where``."""
    text = text.strip()
    digits = text[1:] if text[:1] in ("+", "-", b"+", b"-") else text
    if len(text) > LABEL_TEXT_MAX or not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"{where}: label must be an integer, got {text[:20]!r}")
    return check_label(int(text), where)


def digest(*parts: "bytes | str | np.ndarray | Sequence[str]") -> str:
    """A hex digest of ``parts`` (bytes, text, arrays, lists of names), each length-prefixed so no two
    different inputs meet."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            part = np.ascontiguousarray(part).tobytes()
        elif isinstance(part, str):
            part = part.encode("utf-8", "surrogateescape")
        elif not isinstance(part, (bytes, bytearray, memoryview)):
            part = "\n".join(part).encode("utf-8", "surrogateescape")
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:32]


def relative(paths: Sequence[str]) -> "Sequence[str]":
    """``paths`` less the folder they all share (local paths; URLs come back as they are): the same dataset
    copied to another place (a node's local disk) gives the same names."""
    if not paths or "://" in paths[0]:
        return paths
    lo, hi = min(paths), max(paths)  # the prefix all share is the prefix of these two
    cut = lo.rfind(os.sep, 0, len(os.path.commonprefix([lo, hi]))) + 1
    return [p[cut:] for p in paths] if cut else paths


def fingerprint(source: "Source") -> dict[str, Any]:
    """What identifies ``source`` in a saved state: its sample count and a digest of its paths (``relative``
    to the folder they share) or URLs and, where they are known without reading the data, its labels
    (``source.digest()`` when it has one, else the digest of every ``path(i)``)."""
    own = getattr(source, "digest", None)
    if callable(own):
        return {"samples": len(source), "digest": own()}
    names = relative([source.path(i) for i in range(len(source))])
    return {"samples": len(source), "digest": digest(type(source).__name__, names)}


@runtime_checkable
class Source(Protocol):
    """A random-access dataset of encoded images.

    Implementations are plain picklable objects: worker processes receive a
    copy and call ``read`` themselves, so no bytes cross process boundaries.

    Sources read whole group by group (remote tar shards, Parquet row groups) may also have ``groups``
    (the sizes of consecutive index groups: the epoch order then deals the groups to the ranks and takes
    ``window`` groups at a time, ``sampling.grouped_order``), ``units`` (how many consecutive groups are
    fetched together and stay together in the order, e.g. a remote file's row groups; None: one each) and
    ``readahead(order)`` (main process: given this rank's order of an epoch, an object the scheduler tells
    ``at(submitted, delivered)`` and ``close()``s, or None).
    """

    def __len__(self) -> int: ...

    def path(self, index: int) -> str:
        """A name for sample ``index`` used in error messages (a file path)."""
        ...

    def label(self, index: int) -> int: ...

    def read(self, index: int) -> bytes:
        """The encoded bytes of sample ``index``; OSError names the file. gpufeed's own sources also take
        ``max_bytes`` and refuse a larger sample before reading it (``TooLarge``)."""
        ...


@dataclass(frozen=True)
class FileSource:
    """Samples that are files on a filesystem: ``paths[i]`` with ``labels[i]``."""

    paths: Sequence[str]
    labels: Sequence[int]
    classes: Sequence[str] = ()

    def __post_init__(self) -> None:
        if len(self.paths) != len(self.labels):
            raise ValueError(f"{len(self.paths)} paths but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        return self.paths[index]

    def label(self, index: int) -> int:
        return int(self.labels[index])

    def read(self, index: int, max_bytes: int | None = None) -> bytes:
        return read_file(self.paths[index], max_bytes)

    def digest(self) -> str:
        """The paths (``relative``) and labels, hashed (``fingerprint``): about 0.2 s for a million files."""
        return digest("files", relative(self.paths), np.asarray(self.labels, np.int64))


class Groups:
    """Consecutive groups of samples by size (a source's shards or row groups): where sample i is."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = np.asarray(sizes, np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])
        self._first = self.starts.tolist()

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(group, position within it) of sample ``index``; IndexError outside the groups."""
        if not 0 <= index < self.total:
            raise IndexError(f"sample {index} out of range for {self.total} samples")
        g = bisect.bisect_right(self._first, index) - 1  # a list: no numpy call per sample
        return g, index - self._first[g]

    def of(self, order: Sequence[int]) -> np.ndarray:
        """The group of each entry of ``order``."""
        return np.searchsorted(self.starts, np.asarray(order, np.int64), side="right") - 1
