"""Parquet image tables: the same samples and labels as the folder they came from, local or on S3, with
plain bytes or Hugging Face's {bytes, path} struct, and errors that name the file and column."""

from __future__ import annotations

import collections
import os
import re

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


def _images(spool) -> list[str]:
    """The extracted row groups in a spool folder now."""
    return [n for n in os.listdir(spool.root) if n.endswith(".images")]


def test_parquet_row_groups_are_extracted_once_and_deleted_behind_the_order(synth_root, tmp_path):
    """20 row groups of 2 rows, 4 workers, batches of 4 split across them: each row group is read from
    the Parquet file once (by whichever process came first), not once per worker, and deleted once the
    order has passed it. Made twice: only row groups the next epoch starts with (its first batches are
    started at this epoch's end, after this epoch's copy was deleted)."""
    from gpufeed.sampling import ShardedSampler

    src = folder_source(synth_root)
    folder = _write(src, tmp_path / "pq", row_group_size=2)
    table = parquet_source(folder, readahead=1, window=1)
    assert table.units is None and table.groups == (2,) * 20
    peak, checked = 0, 0
    with ImageLoader(table, **dict(KW, num_workers=4)) as loader:
        for _, labels in loader:
            assert labels.tolist() == [src.label(i) for i in loader.batch_indices]
            checked += len(labels)
            peak = max(peak, len(_images(table.spool)))
        made = table.spool.made()
    assert checked == 40 and _images(table.spool) == []  # closed: every extracted row group deleted

    def item(i):  # the extracted row group of sample i: file i // 20, row group (i % 20) // 2
        return f"{folder / f'train-{i // 20:05d}.parquet'}#{i % 20 // 2}.images"

    assert set(made) == {item(i) for i in range(40)} and len(made) == 20
    # the next epoch's first batches (at most the ring's 4 slots of 4) and the one row group made ahead
    nxt = ShardedSampler(40, groups=table.groups, window=1, seed=KW["seed"], epoch=1).epoch_indices()[:18]
    twice = {name for name, count in made.items() if count > 1}
    assert max(made.values()) <= 2 and twice <= {item(i) for i in nxt}, (made, nxt)
    # on disk at once: the row groups of the ring's 16 samples in flight (at most 9) and the ones made ahead
    assert peak <= 12, peak


def test_parquet_row_groups_the_next_epoch_wants_are_kept_for_it(synth_root, tmp_path):
    """With readahead covering every row group, each epoch's order is told to the source while the one
    before it runs, so no row group is ever deleted between epochs: each extracted once over three
    epochs, and all deleted at the close."""
    src = folder_source(synth_root)
    table = parquet_source(_write(src, tmp_path / "pq", row_group_size=4), readahead=10, window=2)
    epochs = 0
    with ImageLoader(table, **KW) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert sorted(i for _ in loader for i in loader.batch_indices) == list(range(40))
            epochs += 1
        made = table.spool.made()
    assert epochs == 3 and len(made) == 10 and set(made.values()) == {1}, made
    assert _images(table.spool) == []


def test_parquet_bad_rows_are_named_and_labels_stay_with_their_images(synth_root, tmp_path):
    """Row 3 holds bytes that are no image, row 8 a null image, row 12 a null label: skipped, each named
    by file and row, the other samples delivered with their own labels; or the first raises, named."""
    src = folder_source(synth_root)
    ids = range(20)
    images = [b"not a jpeg" if i == 3 else None if i == 8 else src.read(i) for i in ids]
    labels = [None if i == 12 else src.label(i) for i in ids]
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "label": pa.array(labels, pa.int64())}),
                   folder / "t.parquet", row_group_size=5)
    with ImageLoader(folder, on_error="skip", train=False, **KW) as loader:
        delivered = 0
        for _, got in loader:
            assert got.tolist() == [src.label(i) for i in loader.batch_indices]
            assert not {3, 8, 12} & set(loader.batch_indices)
            delivered += len(got)
        skipped = dict(loader.stats["skipped"])
    assert delivered == 17 and sorted(skipped) == [f"{folder / 't.parquet'}[row {r}]" for r in (12, 3, 8)]  # validation: left out
    assert "null" in skipped[f"{folder / 't.parquet'}[row 8]"]
    assert "label column 'label' is null" in skipped[f"{folder / 't.parquet'}[row 12]"]
    with ImageLoader(folder, train=False, **KW) as loader:
        with pytest.raises(Exception, match=r"t\.parquet\[row 3\]"):
            for _ in loader:
                pass


def test_parquet_unreadable_row_group_fails_only_its_samples(synth_root, tmp_path):
    """A row group whose page header is damaged fails each of its samples, naming the file and row
    group; the file's other row groups read as before."""
    src = folder_source(synth_root)
    folder = _write(src, tmp_path / "pq", files=2, row_group_size=7)  # rows 0-19 in row groups of 7, 7, 6
    path = folder / "train-00000.parquet"
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    at = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[at : at + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))
    table = parquet_source(folder)
    good = 0
    for i in range(40):
        if 7 <= i < 14:
            with pytest.raises(OSError, match=r"train-00000\.parquet: cannot read row group 1 \("):
                table.read(i)
        else:
            assert table.read(i) == src.read(i) and table.label(i) == src.label(i)
            good += 1
    assert good == 33


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
        # each file fetched whole and extracted into one item; all of it deleted once the loader closed
        assert set(table.spool.made()) == {f"s3://tables/imgs/train-{f:05d}.parquet.images" for f in (0, 1)}
        # beside the log only the spool's session file, held while the source lives
        assert [n for n in os.listdir(table.spool.root) if not n.startswith(".session-")] == ["made.log"]
    finally:
        server.stop()


def test_parquet_errors_name_the_file_and_column(synth_root, tmp_path):
    src = folder_source(synth_root)
    folder = _write(src, tmp_path / "pq", files=1, image="img")
    with pytest.raises(ValueError, match=r"train-00000\.parquet: no column 'image' \(columns: img, label\)") as e:
        parquet_source(folder)
    assert "parquet_source(PATH, image_column=..., label_column=...) and give that source to ImageLoader" in str(e.value)
    taken = parquet_source(folder, image_column="img")  # the way the message gives works as said
    with ImageLoader(taken, batch_size=8, image_size=16, device="cpu", num_workers=1) as loader:
        assert len(next(iter(loader))[1]) == 8
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


def test_the_spools_log_of_made_items_stays_bounded(tmp_path, monkeypatch):
    from gpufeed.sources import spool as spool_module
    from gpufeed.sources.retry import RetryPolicy

    monkeypatch.setattr(spool_module, "MADE_LOG_BYTES", 200)
    spool = spool_module.Spool(str(tmp_path), None, RetryPolicy())
    names = [f"item-{i:04d}-of-a-long-enough-name" for i in range(60)]  # 32 bytes a line, about 2 kB in all
    for name in names:
        path = spool.local(name, make=lambda p: open(p, "wb").close())
        os.unlink(path)  # as the readahead deletes it behind the order
    logs = sorted(p.name for p in tmp_path.glob(spool_module.MADE_LOG + "*"))
    assert logs == [spool_module.MADE_LOG, spool_module.MADE_LOG + ".1"]
    # a log is turned over at the first write past the limit, and that line still ends it
    assert all((tmp_path / name).stat().st_size <= 200 + 2 * 32 for name in logs)
    made = spool.made()
    assert set(made) <= set(names) and names[-1] in made and all(v == 1 for v in made.values())
    assert 200 // 32 <= sum(made.values()) < len(names)  # the newest lines kept, the oldest dropped


def test_a_parquet_file_is_read_through_the_descriptor_it_was_checked_on(synth_root, tmp_path):
    """A local file is checked (a regular file, the manifest's sha256) on one descriptor and pyarrow reads that
    same descriptor: another file renamed into its place once the check passed is not what gets read; a FIFO
    named like a Parquet file is refused naming it, never waited on for a writer."""
    import hashlib
    import threading

    from gpufeed.sources.checksums import ShardChecksums

    src = folder_source(synth_root)
    folder = _write(src, tmp_path / "pq", files=2, row_group_size=20)  # one row group: one extraction per file
    path = folder / "train-00000.parquet"
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"image": pa.array([src.read(i) for i in range(20)], pa.binary()),
                             "label": pa.array([src.label(i) + 1 for i in range(20)], pa.int64())}), other)

    class SwappedOnceChecked(ShardChecksums):
        """The swap a writer racing the read makes, at the worst moment: right after the check passed."""

        def check(self, shard, fd):
            super().check(shard, fd)
            if other.exists():
                os.replace(other, path)

    table = parquet_source(folder)
    table.checksums = SwappedOnceChecked({p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                          for p in folder.iterdir()}, str(folder / "manifest.json"))
    assert [table.label(i) for i in range(20)] == [src.label(i) for i in range(20)]
    assert not other.exists()  # the swap happened, and the checked file was read all the same

    fifo = tmp_path / "fifo.parquet"
    os.mkfifo(fifo)
    table = parquet_source([str(fifo)], rows=[[20]])
    failed: list[BaseException] = []

    def read() -> None:
        try:
            table.read(0)
        except BaseException as e:
            failed.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(20)
    assert not reader.is_alive(), "waiting on the FIFO for a writer"
    assert len(failed) == 1 and re.search(r"fifo\.parquet: not a regular file \(a FIFO\): give the path of a "
                                          r"Parquet file", str(failed[0])), failed
