"""Parquet image tables: an image-bytes column (plain bytes, or the ``{"bytes": ..., "path": ...}`` struct
Hugging Face datasets write) and an integer label column, in local files or behind URLs.

Row counts come from the files' footers, so the source is random access by index. A row group is read
and decompressed once per machine, not once per worker: the first process that needs it (the loader's
readahead threads, ahead of the epoch's order, or a worker that gets there first) extracts its image
bytes, labels and each row's offset into one local file of the ``Spool`` (an item), under the item's
lock; every worker then reads a sample with one ``pread`` at its offset, as tar members are read. An
item is deleted once the order has passed it (and the next epoch's, told near this one's end, does not
want it yet), so the items in flight and ``readahead`` more (twice that near an epoch's end) are on disk
at a time, and a worker holds only the offsets and labels of the few it has open.

A local file's items are its row groups. A remote file is fetched whole and all its row groups go into
one item (the downloaded copy is deleted once they are out); ``units`` keeps a remote file's row groups
together in the order (``sampling``), so each rank fetches only its own files, each once (and at most the
two it shares with its neighbouring ranks).

An item's layout: the image bytes | rows (n, 4) int64: offset, size (``NULL_IMAGE``, or ``UNREADABLE``:
its row group could not be read), label, the label's state (``LABEL_SET``, ``LABEL_NULL``, or a value that
is no label: ``LABEL_NEGATIVE``, ``LABEL_OVERFLOW`` for an unsigned one past int64, kept as its bits) | JSON
{row group: error} | ``_TRAILER`` (n, the JSON's length, ``_MAGIC``). A row whose label is no label fails
alone, naming the file and row; the rest of its row group is read.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .base import FILE_KINDS, LABEL_MAX, Groups, digest, refuse_over, relative
from .checksums import ShardChecksums
from .fetch import FetchLimits
from .retry import RetryPolicy, with_retries
from .spool import Make, Readahead, Spool
from .urls import is_url, redact, unsigned

_OPEN_ITEMS = 8  # per worker: items held open (one the main process deleted stays readable while open)
_MAGIC = b"GFPQROWS"
_TRAILER = struct.Struct("<qq8s")
NULL_IMAGE, UNREADABLE = -1, -2  # a row's size when it has no image bytes
LABEL_NULL, LABEL_SET, LABEL_NEGATIVE, LABEL_OVERFLOW = 0, 1, 2, 3  # a row's label state


PYARROW_SAFE = (14, 0, 1)  # earlier versions run code from an untrusted Parquet file (CVE-2023-47248)


def _pyarrow():
    return require_pyarrow("reading Parquet")


@functools.cache  # asked for each row group and column: the version is checked once
def require_pyarrow(doing: str):
    """pyarrow, imported and of a safe version; else ImportError saying what ``doing`` needs and how to get it."""
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError:
        raise ImportError(f"{doing} needs pyarrow: pip install 'gpufeed[parquet]'") from None
    if tuple(int(p) for p in re.findall(r"\d+", pyarrow.__version__)[:3]) < PYARROW_SAFE:
        raise ImportError(f"pyarrow {pyarrow.__version__} runs code from an untrusted Parquet file "
                          "(CVE-2023-47248); gpufeed uses pyarrow 14.0.1 or later: pip install 'gpufeed[parquet]'")
    return pyarrow


def _image_values(col, name: str, where: str):
    """The bytes of an image column (an Array): itself when binary, its "bytes" field when a struct (null
    where the struct is)."""
    pa = _pyarrow()
    t = col.type
    if pa.types.is_struct(t):
        if t.get_field_index("bytes") < 0:
            raise ValueError(f"{where}: image column {name!r} is a struct without a 'bytes' field ({t})")
        col = pa.compute.struct_field(col, "bytes")
        if not (pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)):
            raise ValueError(f"{where}: image column {name!r} has a 'bytes' field of {col.type}, not bytes")
        return col
    if not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        raise ValueError(f"{where}: image column {name!r} must hold bytes or a {{bytes, path}} struct, not {t}")
    return col


def _rows(batch, image_column: str, label_column: str, where: str) -> tuple[np.ndarray, memoryview]:
    """A record batch's rows ((n >= 1, 4) int64, offsets from its first image's start) and its image
    bytes, one after another (a view of the batch's buffer)."""
    pa = _pyarrow()
    images = _image_values(batch.column(image_column), image_column, where)
    labels = batch.column(label_column)
    n = len(images)
    wide = pa.types.is_large_binary(images.type)
    _, offsets, data = images.buffers()
    # the values' ends, in the buffers of a possibly sliced array
    ends = np.frombuffer(offsets, np.int64 if wide else np.int32)[images.offset : images.offset + n + 1]
    ends = ends.astype(np.int64)
    rows = np.empty((n, 4), np.int64)
    rows[:, 0] = ends[:-1] - ends[0]
    rows[:, 1] = np.where(images.is_null().to_numpy(zero_copy_only=False), NULL_IMAGE, np.diff(ends))
    rows[:, 2], rows[:, 3] = _labels(labels)
    start, stop = int(ends[0]), int(ends[-1])
    return rows, memoryview(data)[start:stop] if stop > start else memoryview(b"")


def _labels(labels) -> tuple[np.ndarray, np.ndarray]:
    """An integer label column's values as int64 and each row's label state, row by row: a negative value
    or an unsigned one past int64 marks its own row, never the batch (a cast of the column would fail it
    whole)."""
    pa = _pyarrow()
    values = pa.compute.fill_null(labels, 0).to_numpy(zero_copy_only=False)
    state = labels.is_valid().to_numpy(zero_copy_only=False).astype(np.int64)  # LABEL_SET or LABEL_NULL
    if values.dtype.kind == "u" and values.dtype.itemsize == 8:
        state[values > LABEL_MAX] = LABEL_OVERFLOW
        return values.view(np.int64), state  # the bits, so the error can show the value
    values = values.astype(np.int64)
    state[(values < 0) & (state == LABEL_SET)] = LABEL_NEGATIVE
    return values, state


def _read_item(fd: int, name: str) -> tuple[list[list[int]], dict[int, str]]:
    """The rows (lists: they index faster one at a time) and row-group errors of the item open at ``fd``."""
    size = os.fstat(fd).st_size
    if size < _TRAILER.size:
        raise OSError(f"{name}: an extracted row group of {size} bytes is incomplete")
    n, note, magic = _TRAILER.unpack(os.pread(fd, _TRAILER.size, size - _TRAILER.size))
    start = size - _TRAILER.size - note - n * 32
    if magic != _MAGIC or start < 0:
        raise OSError(f"{name}: not an extracted row group (its trailer reads {magic!r})")
    tail = os.pread(fd, n * 32 + note, start)
    rows = np.frombuffer(tail, np.int64, n * 4).reshape(n, 4).tolist()
    return rows, {int(r): e for r, e in json.loads(tail[n * 32 :]).items()}


class ParquetSource:
    """Samples in Parquet ``files`` (local paths or URLs; row group r of file f holds ``rows[f][r]``
    samples), images in ``image_column``, labels in ``label_column`` (picklable). ``spool``: the folder
    of extracted row groups (default: a temporary one); ``ahead``: items made ahead of the order;
    ``window``: row groups whose samples the epoch order shuffles together."""

    def __init__(self, files: Sequence[str], rows: Sequence[Sequence[int]], *, image_column: str = "image",
                 label_column: str = "label", spool: Spool | None = None, ahead: int = 8, window: int = 4) -> None:
        if len(files) != len(rows):
            raise ValueError(f"{len(files)} files but row counts for {len(rows)}")
        if sum(map(sum, rows)) == 0:
            raise ValueError(f"no rows in the Parquet files {[redact(f) for f in list(files)[:3]]}")
        self.files, self.image_column, self.label_column = list(files), image_column, label_column
        self.shown = [redact(f) for f in self.files]  # as errors and paths show them
        self.spool = spool if spool is not None else Spool(None, None, RetryPolicy())
        self.ahead, self.window = ahead, window
        sizes = [(f, r, n) for f, per in enumerate(rows) for r, n in enumerate(per) if n > 0]
        self._file = np.array([f for f, _, _ in sizes], np.int64)
        self._group = np.array([r for _, r, _ in sizes], np.int64)
        self._groups = Groups([n for _, _, n in sizes])
        # the first row of each kept row group within its file, for naming samples
        self._row0 = np.array([sum(rows[f][:r]) for f, r, _ in sizes], np.int64)
        # items: a remote file's row groups together (it is fetched whole), a local file's one each
        whole = [is_url(f) for f in self.files]
        starts_item = [g == 0 or not whole[f] or f != self._file[g - 1] for g, f in enumerate(self._file.tolist())]
        self._item = np.cumsum(starts_item) - 1  # the item of each row group
        self._first = np.append(np.flatnonzero(starts_item), len(sizes))  # item i: row groups [first[i], first[i + 1])
        self._names = []
        for g in self._first[:-1].tolist():
            f = int(self._file[g])
            self._names.append(f"{self.files[f]}.images" if whole[f] else f"{self.files[f]}#{self._group[g]}.images")
        # where each row group's rows begin in its item
        starts = self._groups.starts
        self._in_item = (starts[:-1] - starts[self._first[self._item]]).tolist()
        self._open: collections.OrderedDict[int, tuple[int, list[list[int]], dict[int, str]]] = \
            collections.OrderedDict()
        self.checksums: ShardChecksums | None = None  # set: each file checked before its row groups are read

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_open"] = collections.OrderedDict()
        return state

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(self._groups.sizes.tolist())

    @property
    def units(self) -> tuple[int, ...] | None:
        """Remote files: each file's row groups (their count) stay together in the order, so a rank
        fetches a file once; None when every file is local, whose row groups are extracted one by one."""
        per_item = np.diff(self._first)
        return tuple(per_item.tolist()) if per_item.max(initial=1) > 1 else None

    def __len__(self) -> int:
        return self._groups.total

    def path(self, index: int) -> str:
        g, k = self._groups.locate(index)
        return f"{self.shown[self._file[g]]}[row {int(self._row0[g]) + k}]"

    def _make(self, item: int) -> Make:
        return functools.partial(self._extract, item)

    def _extract(self, item: int, part: str) -> None:
        """Write ``item`` (its row groups' image bytes and rows, module docstring) to ``part``; OSError
        naming the file when it cannot be fetched or opened."""
        pa = _pyarrow()
        groups = range(int(self._first[item]), int(self._first[item + 1]))
        f = int(self._file[groups[0]])
        url, shown = self.files[f], self.shown[f]
        local = part + ".download" if is_url(url) else url
        try:
            if local != url:
                self.spool.fetch(url, local)
            # pyarrow reads the file checked here, through its descriptor: a file put in its place since is not read
            with open(self._checked(local, url, shown), "rb") as f:
                try:
                    pf = pa.parquet.ParquetFile(f)
                except Exception as e:  # pyarrow's errors for a corrupt or cut-short file
                    raise OSError(f"{shown}: cannot open the Parquet file ({type(e).__name__}: {e})") from None
                with pf, open(part, "wb") as out:
                    self._write_groups(pf, groups, shown, out)
        finally:
            if local != url and os.path.exists(local):
                os.unlink(local)

    def _checked(self, local: str, url: str, shown: str) -> int:
        """A descriptor of the regular file at ``local`` (the file ``url`` names, or its fetched copy), checked
        against the manifest's sha256 when ``checksums`` is set; OSError naming ``shown`` otherwise."""
        fd = os.open(local, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, to be refused below
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise OSError(f"{shown}: not a regular file ({FILE_KINDS.get(stat.S_IFMT(mode), 'of another kind')}): "
                              "give the path of a Parquet file")
            if self.checksums is not None:
                self.checksums.check(url, fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write_groups(self, pf, groups: range, url: str, out) -> None:
        """Row groups ``groups`` of the open file ``pf`` (from ``url``, as shown) as an item, into ``out``. A row
        group that cannot be read is recorded in the item, and fails its samples when they are read."""
        rows, errors = [], {}
        for g in groups:
            r, expected = int(self._group[g]), int(self._groups.sizes[g])
            try:  # batch by batch: no copy into one array (whose offsets a large row group overflows)
                table = pf.read_row_group(r, columns=[self.image_column, self.label_column])
                parts = [_rows(b, self.image_column, self.label_column, url) for b in table.to_batches() if b.num_rows]
                if sum(len(got) for got, _ in parts) != expected:
                    raise ValueError(f"{table.num_rows} rows, {expected} in the footer the loader read")
            except Exception as e:  # pyarrow's errors for a damaged row group, or a column of another type
                why = " ".join(str(e).split())  # pyarrow's messages run over lines
                errors[r] = f"{url}: cannot read row group {r} ({type(e).__name__}: {why})"
                unreadable = np.zeros((expected, 4), np.int64)
                unreadable[:, 1] = UNREADABLE
                parts = [(unreadable, memoryview(b""))]
            for got, data in parts:
                got[:, 0] += out.tell()
                out.write(data)
                rows.append(got)
        note = json.dumps(errors).encode()
        every = np.concatenate(rows)
        out.write(every.tobytes())
        out.write(note)
        out.write(_TRAILER.pack(len(every), len(note), _MAGIC))

    def _held(self, g: int) -> tuple[int, list[list[int]], dict[int, str]]:
        """Row group ``g``'s item, open: its descriptor, rows and row-group errors."""
        item = int(self._item[g])
        held = self._open.get(item)
        if held is not None:
            self._open.move_to_end(item)
            return held
        fd, _ = self.spool.open(self._names[item], self._make(item))
        try:
            rows, errors = _read_item(fd, self._names[item])
        except OSError:
            os.close(fd)
            raise
        self._open[item] = held = (fd, rows, errors)
        if len(self._open) > _OPEN_ITEMS:
            os.close(self._open.popitem(last=False)[1][0])
        return held

    def _row(self, index: int) -> tuple[int, list[int]]:
        """The descriptor of sample ``index``'s item and its row: offset, size, label, label set."""
        g, k = self._groups.locate(index)
        fd, rows, errors = self._held(g)
        row = rows[self._in_item[g] + k]
        if row[1] == UNREADABLE:
            raise OSError(errors[int(self._group[g])])
        return fd, row

    def read(self, index: int, max_bytes: int | None = None) -> bytes:
        fd, (offset, size, _, _) = self._row(index)
        if size == NULL_IMAGE:
            raise OSError(f"{self.path(index)}: the image column {self.image_column!r} is null")
        refuse_over(size, max_bytes, self.path(index))
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise OSError(f"{self.path(index)}: read {len(data)} of {size} bytes of its extracted row group")
        return data

    def label(self, index: int) -> int:
        _, (_, _, label, state) = self._row(index)
        if state == LABEL_SET:
            return label
        if state == LABEL_NULL:
            raise ValueError(f"{self.path(index)}: the label column {self.label_column!r} is null")
        value = label % (1 << 64) if state == LABEL_OVERFLOW else label  # an unsigned value's bits
        raise ValueError(f"{self.path(index)}: label must be an integer in [0, 2**63), got {value} in the label "
                         f"column {self.label_column!r}")

    def digest(self) -> str:
        """The files (local ones ``base.relative``, URLs as signed for no one: ``urls.unsigned``), their row
        groups' sizes and the columns, hashed (``base.fingerprint``)."""
        return digest("parquet", relative([unsigned(f) for f in self.files]), self._file, self._groups.sizes,
                      self.image_column, self.label_column)

    def readahead(self, order: Sequence[int]) -> Readahead:
        """Main process: extract the row groups along ``order`` ahead of the workers (``Spool.readahead``)."""
        return self.spool.readahead(self._names, self._item[self._groups.of(order)], self.ahead, self._make)

    def __del__(self) -> None:
        for fd, _, _ in getattr(self, "_open", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


def parquet_files(path: str | os.PathLike | Sequence[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """The Parquet files of a file, a folder (recursively, sorted), a folder URL, or a list."""
    from .remote_tar import shard_urls

    if isinstance(path, (list, tuple)):
        return [str(p) for p in path]
    path = str(path) if isinstance(path, os.PathLike) else path
    if is_url(path):
        return shard_urls(path, storage_options, suffix=".parquet")[0]
    p = Path(path)
    if p.is_file():
        return [str(p)]
    files = sorted(str(f) for f in p.rglob("*.parquet")) if p.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no .parquet files in {path!r}")
    return files


def parquet_source(path: str | os.PathLike | Sequence[str], *, image_column: str = "image",
                   label_column: str = "label", storage_options: dict[str, Any] | None = None,
                   retry: RetryPolicy = RetryPolicy(), spool_dir: str | None = None, readahead: int = 8,
                   window: int = 4, direct_get: bool = True, limits: FetchLimits = FetchLimits(),
                   rows: Sequence[Sequence[int]] | None = None) -> ParquetSource:
    """A Parquet file, a folder of them, a URL of either, or a list. Reads each file's footer (its row
    groups' sizes and schema, checked here), unless ``rows`` gives each file's row-group sizes (a shard
    manifest's: the files are then not opened until read); ``image_column``/``label_column`` name the columns.
    Row groups are extracted into ``spool_dir`` (default: a temporary folder), remote files fetched whole
    into it, ``readahead`` items (a local file's row groups, remote files) ahead of the workers;
    ``window``: row groups whose samples the epoch order shuffles together; ``direct_get``, ``limits`` and
    ``spool_dir`` as for ``remote_tar_source``."""
    pa = _pyarrow()
    files = parquet_files(path, storage_options)
    spool = Spool(spool_dir, storage_options, retry, direct_get, limits)
    if rows is not None:
        if len(rows) != len(files):
            raise ValueError(f"rows gives row groups for {len(rows)} files, but there are {len(files)}")
        return ParquetSource(files, rows, image_column=image_column, label_column=label_column, spool=spool,
                             ahead=readahead, window=window)
    rows = []
    for f in files:
        def footer(f=f):
            if not is_url(f):
                return pa.parquet.ParquetFile(f)
            with spool.filesystem(f).open(f, "rb") as fh:
                return pa.parquet.ParquetFile(fh)
        try:
            pf = with_retries(footer, f, retry, "read the Parquet footer") if is_url(f) else footer()
        except pa.ArrowInvalid as e:
            raise ValueError(f"{redact(f)}: not a Parquet file ({e})") from None
        schema = pf.schema_arrow
        for column in (image_column, label_column):
            if schema.get_field_index(column) < 0:
                raise ValueError(f"{redact(f)}: no column {column!r} (columns: {', '.join(schema.names)}); "
                                 "name the columns to read with gpufeed.sources.parquet_source(PATH, "
                                 "image_column=..., label_column=...) and give that source to ImageLoader")
        label_type = schema.field(label_column).type
        if not pa.types.is_integer(label_type):
            raise ValueError(f"{redact(f)}: label column {label_column!r} must hold integers, not {label_type}")
        _image_values(pa.array([], schema.field(image_column).type), image_column, redact(f))
        rows.append([pf.metadata.row_group(r).num_rows for r in range(pf.metadata.num_row_groups)])
    return ParquetSource(files, rows, image_column=image_column, label_column=label_column, spool=spool,
                         ahead=readahead, window=window)
