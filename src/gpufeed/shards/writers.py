"""Shard files, the same bytes for the same samples: WebDataset tar or Parquet, written to a local path.

Tar: ``<key>.<ext>`` (the image) then ``<key>.cls`` (the label in decimal) per sample, ustar headers with
mtime 0, uid/gid 0, no user or group names, mode 0644. Parquet: an ``image`` struct {bytes, path} and an
int64 ``label``, row groups of ``ROWS_PER_GROUP``, no compression (JPEG bytes do not compress), no
statistics, and Hugging Face's ``features`` in the schema metadata (so ``datasets`` reads the images as
images); pyarrow writes no time into the file.
"""

from __future__ import annotations

import io
import json
import tarfile
from typing import Protocol, Sequence

ROWS_PER_GROUP = 1024  # the unit the loader extracts and shuffles a few of at a time (sources/parquet.py)


class ShardWriter(Protocol):
    """Samples in, one after another; ``close`` finishes the file."""

    row_groups: list[int]  # Parquet: the rows of each row group written (tar: empty)

    def add(self, key: str, ext: str, data: bytes, label: int, path: str) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


def utf8_name(path: str) -> str:
    """A file name as Parquet's string column can hold it: a name whose bytes are not UTF-8 (read with
    Python's surrogate escapes) keeps each such byte as ``\\xNN``, the rest as it is."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def create_writer(format: str, path: str, classes: Sequence[str]) -> ShardWriter:
    return TarWriter(path) if format == "tar" else ParquetWriter(path, classes)


def sample_bytes(format: str, data: bytes, path: str) -> int:
    """About what one sample adds to a shard of ``format`` (for sizing shards in bytes)."""
    if format == "tar":  # the image's header and padded data, the label's header and one block
        return tarfile.BLOCKSIZE + -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE + 2 * tarfile.BLOCKSIZE
    return len(data) + len(path.encode("utf-8", "surrogateescape")) + 16  # values, offsets, label


class TarWriter:
    def __init__(self, path: str) -> None:
        self.row_groups: list[int] = []
        self._file = open(path, "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)

    def add(self, key: str, ext: str, data: bytes, label: int, path: str) -> None:
        self._member(f"{key}.{ext}", data)
        self._member(f"{key}.cls", str(label).encode())

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        self._tar.close()
        self._file.close()

    def abort(self) -> None:
        self._file.close()


class ParquetWriter:
    def __init__(self, path: str, classes: Sequence[str]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pa = pa
        label = {"names": list(classes), "_type": "ClassLabel"} if classes else {"dtype": "int64", "_type": "Value"}
        features = {"info": {"features": {"image": {"_type": "Image"}, "label": label}}}
        self._type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        self._schema = pa.schema([("image", self._type), ("label", pa.int64())],
                                 metadata={"huggingface": json.dumps(features, sort_keys=True)})
        self._writer = pq.ParquetWriter(path, self._schema, compression="none", use_dictionary=False,
                                        write_statistics=False)
        self._rows: list[dict] = []
        self._labels: list[int] = []
        self.row_groups: list[int] = []

    def add(self, key: str, ext: str, data: bytes, label: int, path: str) -> None:
        self._rows.append({"bytes": data, "path": utf8_name(path)})
        self._labels.append(label)
        if len(self._rows) == ROWS_PER_GROUP:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        pa = self._pa
        table = pa.table({"image": pa.array(self._rows, self._type), "label": pa.array(self._labels, pa.int64())},
                         schema=self._schema)
        self._writer.write_table(table, row_group_size=len(self._rows))
        self.row_groups.append(len(self._rows))
        self._rows, self._labels = [], []

    def close(self) -> None:
        self._flush()
        self._writer.close()

    def abort(self) -> None:
        self._writer.close()
