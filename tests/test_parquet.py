"""Parquet image tables: the same samples and labels as the folder they came from, local or on S3, with
plain bytes or Hugging Face's {bytes, path} struct, and errors that name the file and column."""

from __future__ import annotations

import collections

import pytest
import torch

from gpufeed import ImageLoader
from gpufeed.sources import create_source, folder_source, parquet_source

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

KW = dict(batch_size=4, image_size=16, device="cpu", num_workers=2, seed=5)


def _write(src, folder, *, struct=False, files=2, row_group_size=7, image="image", label="label"):
    """``src``'s samples as ``files`` Parquet files of row groups of ``row_group_size`` rows."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(src)
    per = -(-n // files)
    for f in range(files):
        ids = range(f * per, min(n, (f + 1) * per))
        data = [src.read(i) for i in ids]
        column = (pa.array([{"bytes": d, "path": f"{i}.jpg"} for i, d in zip(ids, data)]) if struct
                  else pa.array(data, pa.binary()))
        table = pa.table({image: column, label: pa.array([src.label(i) for i in ids], pa.int64())})
        pq.write_table(table, folder / f"train-{f:05d}.parquet", row_group_size=row_group_size)
    return folder


@pytest.mark.parametrize("struct", [False, True])
def test_parquet_gives_the_folder_samples_and_labels(synth_root, tmp_path, struct):
    src = folder_source(synth_root)
    table = create_source(_write(src, tmp_path / "pq", struct=struct))
    assert len(table) == 40 and table.groups == (7, 7, 6, 7, 7, 6)  # 2 files of 20 rows, row groups of 7
    for i in range(40):
        assert table.read(i) == src.read(i) and table.label(i) == src.label(i)
    assert table.path(27).endswith("train-00001.parquet[row 7]")


def test_loader_over_parquet_equals_loader_over_the_folder(synth_root, tmp_path):
    src = folder_source(synth_root)
    folder = _write(src, tmp_path / "pq", struct=True)
    with ImageLoader(synth_root, train=False, **KW) as a, ImageLoader(folder, train=False, **KW) as b:
        for (xa, ya), (xb, yb) in zip(a, b, strict=True):
            assert torch.equal(ya, yb) and torch.equal(xa, xb)
            assert a.batch_indices == b.batch_indices
    with ImageLoader(folder, **KW) as loader:  # training order: row groups a few at a time, each sample once
        seen = []
        for _, labels in loader:
            assert labels.tolist() == [src.label(i) for i in loader.batch_indices]
            seen += loader.batch_indices
    assert sorted(seen) == list(range(40))


def test_parquet_memory_is_bounded_by_row_groups(synth_root, tmp_path):
    """A worker keeps window + 1 row groups, however many it has read."""
    src = folder_source(synth_root)
    table = parquet_source(_write(src, tmp_path / "pq", row_group_size=3), window=2)
    for i in range(40):
        table.read(i)
    assert len(table._cache) == 3


def test_parquet_on_s3_with_named_columns(synth_root, tmp_path):
    from .servers import S3Server

    src = folder_source(synth_root)
    folder = _write(src, tmp_path / "pq", image="jpeg", label="cls")
    server = S3Server()
    try:
        server.bucket("tables")
        for f in sorted(folder.iterdir()):
            server.put("tables", f"imgs/{f.name}", f.read_bytes())
        table = parquet_source("s3://tables/imgs/", image_column="jpeg", label_column="cls",
                               storage_options=server.storage_options)
        assert len(table) == 40
        for i in (0, 19, 20, 39):
            assert table.read(i) == src.read(i) and table.label(i) == src.label(i)
        with ImageLoader(table, **KW) as loader:
            counts = collections.Counter(i for _ in loader for i in loader.batch_indices)
        assert set(counts) == set(range(40)) and max(counts.values()) == 1
    finally:
        server.stop()


def test_parquet_errors_name_the_file_and_column(synth_root, tmp_path):
    src = folder_source(synth_root)
    folder = _write(src, tmp_path / "pq", files=1, image="img")
    with pytest.raises(ValueError, match=r"train-00000\.parquet: no column 'image' \(columns: img, label\)"):
        parquet_source(folder)
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.table({"image": pa.array([b"x"]), "label": pa.array(["cat"])}), bad / "a.parquet")
    with pytest.raises(ValueError, match=r"a\.parquet: label column 'label' must hold integers, not string"):
        parquet_source(bad)


def test_remote_parquet_ranks_fetch_only_their_own_files_once(synth_root, tmp_path):
    """6 files (7 rows each, the last 5; row groups of 3) on S3 over 3 ranks: a file's row groups stay
    together in the order, so each rank (its own access key) fetches 2 to 4 files, not all 6, each once:
    its run's, and one for a padding sample; besides those, only its next epoch's first ones (started at
    this epoch's end). Every sample once across the ranks, its padding of 2 aside."""
    from gpufeed.sampling import ShardedSampler

    from .servers import S3Server

    src = folder_source(synth_root)
    folder = _write(src, tmp_path / "pq", files=6, row_group_size=3)
    server = S3Server()
    try:
        server.bucket("tables")
        for f in sorted(folder.iterdir()):
            server.put("tables", f"imgs/{f.name}", f.read_bytes())
        delivered = []
        for rank in range(3):
            key = f"rank{rank}"
            table = parquet_source("s3://tables/imgs/", storage_options=dict(server.storage_options, key=key))
            assert table.units == (3, 3, 3, 3, 3, 2) and table.groups == (3, 3, 1) * 5 + (3, 2)
            footers = len(server.gets(key, ".parquet"))  # read when the source was made
            with ImageLoader(table, rank=rank, world_size=3, drop_last=False, **KW) as loader:
                ids = [i for _ in loader for i in loader.batch_indices]
            delivered += ids
            mine = {i // 7 for i in ids}
            after = ShardedSampler(40, groups=table.groups, units=table.units, seed=KW["seed"], rank=rank,
                                   world_size=3, epoch=1)
            nxt = {i // 7 for i in after.epoch_indices()}
            fetched = collections.Counter(int(p[-13:-8]) for p in server.gets(key, ".parquet")[footers:])
            assert len(ids) == 14 and 2 <= len(mine) <= 4 and 2 <= len(nxt) <= 4, (mine, nxt)
            assert mine <= set(fetched) <= mine | nxt and sum(fetched.values()) <= len(mine) + len(nxt), fetched
        counts = collections.Counter(delivered)
        assert set(counts) == set(range(40)) and sum(counts.values()) == 42
    finally:
        server.stop()
