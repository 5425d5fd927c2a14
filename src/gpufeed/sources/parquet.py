"""Parquet image tables: an image-bytes column (plain bytes, or the ``{"bytes": ..., "path": ...}`` struct
Hugging Face datasets write) and an integer label column, in local files or behind URLs.

Row counts come from the files' footers, so the source is random access by index; a worker reads the
row group holding a sample and keeps the last ``window + 1`` row groups it read, so its memory is bounded
by that many row groups. ``groups`` gives the sampler the row groups' sizes, so the epoch order takes a few
row groups at a time and deals them to the ranks (``sampling``). Remote files are fetched whole into the
``Spool`` ahead of the order; ``units`` keeps a remote file's row groups together in the order, so each rank
fetches only its own files, each once (and at most the two it shares with its neighbouring ranks).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .base import Groups
from .retry import RetryPolicy, with_retries
from .spool import Readahead, Spool
from .urls import is_url

_OPEN_FILES = 8  # per worker: Parquet files held open


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError("reading Parquet needs pyarrow: pip install 'gpufeed[parquet]'") from None
    return pyarrow


def _image_values(col, name: str, where: str):
    """The bytes of an image column: itself when binary, its "bytes" field when a struct."""
    pa = _pyarrow()
    t = col.type
    if pa.types.is_struct(t):
        if t.get_field_index("bytes") < 0:
            raise ValueError(f"{where}: image column {name!r} is a struct without a 'bytes' field ({t})")
        return col.field("bytes")
    if not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        raise ValueError(f"{where}: image column {name!r} must hold bytes or a {{bytes, path}} struct, not {t}")
    return col


class ParquetSource:
    """Samples in Parquet ``files`` (local paths or URLs; row group r of file f holds ``rows[f][r]``
    samples), images in ``image_column``, labels in ``label_column`` (picklable)."""

    def __init__(self, files: Sequence[str], rows: Sequence[Sequence[int]], *, image_column: str = "image",
                 label_column: str = "label", spool: Spool | None = None, ahead: int = 8, window: int = 4) -> None:
        if len(files) != len(rows):
            raise ValueError(f"{len(files)} files but row counts for {len(rows)}")
        self.files, self.image_column, self.label_column = list(files), image_column, label_column
        self.spool, self.ahead, self.window = spool, ahead, window
        sizes = [(f, r, n) for f, per in enumerate(rows) for r, n in enumerate(per) if n > 0]
        self._file = np.array([f for f, _, _ in sizes], np.int64)
        self._group = np.array([r for _, r, _ in sizes], np.int64)
        self._groups = Groups([n for _, _, n in sizes])
        # the first row of each kept row group within its file, for naming samples
        self._row0 = np.array([sum(rows[f][:r]) for f, r, _ in sizes], np.int64)
        self._cache: collections.OrderedDict[int, tuple[Any, np.ndarray]] = collections.OrderedDict()
        self._handles: dict[int, Any] = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_cache"], state["_handles"] = collections.OrderedDict(), {}
        return state

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(self._groups.sizes.tolist())

    @property
    def units(self) -> tuple[int, ...] | None:
        """Remote files: each file's row groups (their count) stay together in the order, so a rank
        fetches a file once; None for local files, whose row groups are read in place."""
        if self.spool is None:
            return None
        return tuple(np.bincount(self._file)[np.unique(self._file)].tolist())

    def __len__(self) -> int:
        return self._groups.total

    def path(self, index: int) -> str:
        g, k = self._groups.locate(index)
        return f"{self.files[self._file[g]]}[row {int(self._row0[g]) + k}]"

    def _load(self, g: int) -> tuple[Any, np.ndarray]:
        held = self._cache.get(g)
        if held is not None:
            self._cache.move_to_end(g)
            return held
        pq = _pyarrow().parquet
        f = int(self._file[g])
        handle = self._handles.get(f)
        if handle is None:
            url = self.files[f]
            if self.spool is None:
                handle = pq.ParquetFile(url)
            else:  # the descriptor keeps the local copy readable even once the main process deletes it
                fd, _ = self.spool.open(url)
                handle = pq.ParquetFile(os.fdopen(fd, "rb"))
            self._handles[f] = handle
            if len(self._handles) > _OPEN_FILES:
                self._handles.pop(next(iter(self._handles))).close()
        try:
            table = handle.read_row_group(int(self._group[g]), columns=[self.image_column, self.label_column])
        except Exception as e:  # pyarrow's errors for corrupt or cut-short files: name the file and row group
            raise OSError(f"{self.files[f]}: cannot read row group {int(self._group[g])} "
                          f"({type(e).__name__}: {e})") from None
        where = self.files[f]
        images = _image_values(table.column(self.image_column).combine_chunks(), self.image_column, where)
        labels = table.column(self.label_column).to_numpy(zero_copy_only=False)
        self._cache[g] = held = (images, labels)
        if len(self._cache) > self.window + 1:
            self._cache.popitem(last=False)
        return held

    def read(self, index: int) -> bytes:
        g, k = self._groups.locate(index)
        data = self._load(g)[0][k].as_py()
        if data is None:
            raise OSError(f"{self.path(index)}: the image column {self.image_column!r} is null")
        return data

    def label(self, index: int) -> int:
        g, k = self._groups.locate(index)
        label = self._load(g)[1][k]
        if label is None or label != label:  # null (None, or NaN after a nullable column's conversion)
            raise ValueError(f"{self.path(index)}: the label column {self.label_column!r} is null")
        return int(label)

    def readahead(self, order: Sequence[int]) -> Readahead | None:
        if self.spool is None:
            return None  # local files are read in place
        return self.spool.readahead(self.files, self._file[self._groups.of(order)], self.ahead)


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
                   window: int = 4, direct_get: bool = True) -> ParquetSource:
    """A Parquet file, a folder of them, a URL of either, or a list. Reads each file's footer (its row
    groups' sizes and schema, checked here); ``image_column``/``label_column`` name the columns.
    Remote files are fetched whole into ``spool_dir`` (default: a temporary folder), ``readahead`` files
    ahead of the workers; ``window``: row groups whose samples the epoch order shuffles together;
    ``direct_get`` as for ``remote_tar_source``."""
    pa = _pyarrow()
    files = parquet_files(path, storage_options)
    remote = [is_url(f) for f in files]
    spool = Spool(spool_dir, storage_options, retry, direct_get) if any(remote) else None
    rows: list[list[int]] = []
    for f, is_remote in zip(files, remote):
        def footer(f=f, is_remote=is_remote):
            if not is_remote:
                return pa.parquet.ParquetFile(f)
            with spool.filesystem(f).open(f, "rb") as fh:
                return pa.parquet.ParquetFile(fh)
        try:
            pf = with_retries(footer, f, retry, "read the Parquet footer") if is_remote else footer()
        except pa.ArrowInvalid as e:
            raise ValueError(f"{f}: not a Parquet file ({e})") from None
        schema = pf.schema_arrow
        for column in (image_column, label_column):
            if schema.get_field_index(column) < 0:
                raise ValueError(f"{f}: no column {column!r} (columns: {', '.join(schema.names)}); "
                                 "name them with image_column= / label_column=")
        label_type = schema.field(label_column).type
        if not pa.types.is_integer(label_type):
            raise ValueError(f"{f}: label column {label_column!r} must hold integers, not {label_type}")
        _image_values(pa.array([], schema.field(image_column).type), image_column, f)
        rows.append([pf.metadata.row_group(r).num_rows for r in range(pf.metadata.num_row_groups)])
    if sum(map(sum, rows)) == 0:
        raise ValueError(f"no rows in the Parquet files of {path!r}")
    return ParquetSource(files, rows, image_column=image_column, label_column=label_column,
                         spool=spool if any(remote) else None, ahead=readahead, window=window)
