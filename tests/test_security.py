"""Hostile local input through the public API: Pillow's process-wide guard, symlink loops, bad labels,
foreign and malformed states, reads that never return, files too large to read, an all-broken folder
under skip. Every hostile file is made here."""

from __future__ import annotations

import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from gpufeed import ImageLoader, WorkerError
from gpufeed.sources import FileSource, create_source, filelist_source, tar_source

from .conftest import jpeg_bytes

KW = dict(batch_size=4, image_size=16, device="cpu", num_workers=2, train=False, drop_last=False)


def _folder(root, names, bad=()):
    """Class folder ``root/c`` of tiny JPEGs named ``names`` (junk bytes for those in ``bad``)."""
    (root / "c").mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        (root / "c" / name).write_bytes(b"not an image" if name in bad else jpeg_bytes(24, 20, seed=i))
    return root


# ---- bytes are data: no file reaches another program ---------------------------------------------


def _tripwire(tmp_path):
    """(an environment whose PATH starts with a ``gs`` that records each call, the record's path): Pillow
    runs the first ``gs`` on PATH to render an EPS file."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "gs-calls"
    bin_dir.mkdir()
    (bin_dir / "gs").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    (bin_dir / "gs").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(sys.path)}, calls


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for Ghostscript")
def test_an_eps_named_jpg_reaches_no_external_program(tmp_path):
    """An EPS file named photo.jpg in a class folder, with a stand-in ``gs`` on PATH: the loader skips it,
    naming it and saying it is no format gpufeed reads, `gpufeed shards` lists it as broken, the bench's
    DataLoader refuses it, and ``gs`` is never run. Each in a fresh process, so that PATH reaches the workers."""
    from .corpus import EPS

    data = _folder(tmp_path / "data", ["a.jpg", "b.jpg", "c.jpg"])
    (data / "c" / "photo.jpg").write_bytes(EPS)
    env, calls = _tripwire(tmp_path)
    load = ("import sys; from gpufeed import ImageLoader\n"
            "with ImageLoader(sys.argv[1], batch_size=4, image_size=16, device='cpu', num_workers=2, train=False,\n"
            "                 drop_last=False, on_error='skip') as loader:\n"
            "    print(sum(len(y) for _, y in loader), loader.stats['skipped'])")
    out = subprocess.run([sys.executable, "-c", load, str(data)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("3 ") and "photo.jpg" in out.stdout, out.stdout
    assert "not an image of a format gpufeed reads" in out.stdout, out.stdout
    dest = tmp_path / "shards"
    out = subprocess.run([sys.executable, "-m", "gpufeed", "shards", str(data), str(dest), "--workers", "1",
                          "--max-side", "16"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    broken = json.loads((dest / "manifest.json").read_text())["broken"]
    assert [Path(b["path"]).name for b in broken] == ["photo.jpg"], broken
    assert "not an image of a format gpufeed reads" in broken[0]["reason"]
    baseline = ("import sys; from gpufeed.bench.baseline import create_baseline_loader\n"
                "try:\n    list(create_baseline_loader(sys.argv[1], batch_size=4, num_workers=0, image_size=16))\n"
                "except Exception as e:\n    print(type(e).__name__)")
    out = subprocess.run([sys.executable, "-c", baseline, str(data)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "UnidentifiedImageError", (out.stdout, out.stderr)
    assert not calls.exists(), calls.read_text()


# ---- no process-wide side effects ---------------------------------------------------------------


def test_importing_gpufeed_leaves_pillows_guard_as_it_was():
    code = ("from PIL import Image; before = Image.MAX_IMAGE_PIXELS; import gpufeed, gpufeed.decode.cpu, "
            "gpufeed.workers.chunks; print(before, Image.MAX_IMAGE_PIXELS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout.split()
    assert out[0] == out[1] != "None", out


def test_workers_apply_max_pixels_while_the_users_pillow_guard_stays(tmp_path, monkeypatch):
    """The user's process keeps a strict Pillow guard (1,000 pixels); the workers decode a 64 x 64 PNG
    under gpufeed's own cap, and refuse it, naming it, under max_pixels=1,000."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    (tmp_path / "c").mkdir()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(tmp_path / "c" / "big.jpg", "PNG")
    with pytest.raises(Image.DecompressionBombError):  # the guard is live in this process
        Image.open(tmp_path / "c" / "big.jpg")
    with ImageLoader(tmp_path, **KW) as loader:
        (images, labels), = list(loader)
    assert images.shape == (1, 3, 16, 16) and Image.MAX_IMAGE_PIXELS == 1000
    with ImageLoader(tmp_path, max_pixels=1000, **KW) as loader:
        with pytest.raises(WorkerError, match=r"big\.jpg.*over max_pixels=1000"):
            list(loader)
    assert Image.MAX_IMAGE_PIXELS == 1000


# ---- folders walked safely -----------------------------------------------------------------------


def test_a_symlink_loop_is_listed_once_and_reported(tmp_path, caplog):
    _folder(tmp_path, ["a.jpg"])
    (tmp_path / "c" / "sub").mkdir()
    (tmp_path / "c" / "sub" / "b.jpg").write_bytes(jpeg_bytes(24, 20, seed=9))
    os.symlink(tmp_path / "c", tmp_path / "c" / "sub" / "loop")  # back up to the class folder
    os.symlink(tmp_path / "c" / "sub", tmp_path / "c" / "zz_again")  # the same folder under a second name
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        with ImageLoader(tmp_path, **KW) as loader:
            delivered = [i for _ in loader for i in loader.batch_indices]
            paths = [loader.source.path(i) for i in range(len(loader.source))]
    assert [os.path.relpath(p, tmp_path) for p in paths] == ["c/a.jpg", "c/sub/b.jpg"] and sorted(delivered) == [0, 1]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "sub/loop" in warned and "zz_again" in warned and "listed once" in warned


# ---- labels --------------------------------------------------------------------------------------


def _tar_with_labels(path, labels):
    """A WebDataset shard: sample k is ``{k:06d}.jpg`` with a ``.cls`` holding ``labels[k]`` (bytes)."""
    with tarfile.open(path, "w") as tf:
        for k, text in enumerate(labels):
            for name, data in ((f"{k:06d}.jpg", jpeg_bytes(24, 20, seed=k)), (f"{k:06d}.cls", text)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


TAR_LABELS = [b"0", b"1", b"-3", b"cat", b"1000000000000", b"2", b"9" * 30, b"1"]


def test_bad_tar_labels_fail_alone_naming_shard_and_member(tmp_path):
    shard = _tar_with_labels(tmp_path / "s.tar", TAR_LABELS)
    source = tar_source(shard)
    assert [source.label(k) for k in (0, 1, 5, 7)] == [0, 1, 2, 1] and source.label(4) == 10**12
    with pytest.raises(ValueError, match=r"s\.tar:000002\.cls: label must be >= 0, got -3"):
        source.label(2)
    with pytest.raises(ValueError, match=r"000006\.cls: label 9{30} does not fit in int64"):
        source.label(6)
    with pytest.raises(ValueError, match=r"000003\.cls: label must be an integer, got b'cat'"):
        source.label(3)
    with ImageLoader(shard, num_classes=3, on_error="skip", **KW) as loader:
        labels = [y for _, ys in loader for y in ys.tolist()]
        skipped = {os.path.basename(p): r for p, r in loader.stats["skipped"]}
    assert sorted(skipped) == [f"s.tar:{k:06d}.jpg" for k in (2, 3, 4, 6)], skipped
    assert "not below num_classes=3" in skipped["s.tar:000004.jpg"] and "got -3" in skipped["s.tar:000002.jpg"]
    assert labels == [0, 1, 2, 1]  # validation: the four bad samples left out, the good ones in order
    with ImageLoader(shard, num_classes=3, **KW) as loader:
        with pytest.raises(WorkerError, match=r"s\.tar:000002\.jpg.*label must be >= 0, got -3"):
            list(loader)


def test_an_overflowing_parquet_label_fails_its_row_alone(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    images = [jpeg_bytes(24, 20, seed=i) for i in range(8)]
    unsigned = pa.table({"image": pa.array(images, pa.binary()),
                         "label": pa.array([0, 1, 2, 2**64 - 1, 1, 0, 2, 1], pa.uint64())})
    signed = pa.table({"image": pa.array(images, pa.binary()),
                       "label": pa.array([0, 1, -5, 2, 1, 0, 2, 1], pa.int64())})
    pq.write_table(unsigned, tmp_path / "a.parquet", row_group_size=8)  # one row group each
    pq.write_table(signed, tmp_path / "b.parquet", row_group_size=8)
    table = create_source([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])
    assert [table.label(i) for i in (0, 1, 2, 4, 8, 9, 11)] == [0, 1, 2, 1, 0, 1, 2]
    with pytest.raises(ValueError, match=r"a\.parquet\[row 3\]: label must be an integer in \[0, 2\*\*63\), "
                                         r"got 18446744073709551615"):
        table.label(3)
    with pytest.raises(ValueError, match=r"b\.parquet\[row 2\]: label must be .* got -5"):
        table.label(10)
    with ImageLoader(table, on_error="skip", **KW) as loader:
        delivered = [(i, y) for _, ys in loader for i, y in zip(loader.batch_indices, ys.tolist())]
        skipped = sorted(os.path.basename(p) for p, _ in loader.stats["skipped"])
    assert skipped == ["a.parquet[row 3]", "b.parquet[row 2]"]
    assert {i for i, _ in delivered} == set(range(16)) - {3, 10}
    assert all(y == table.label(i) for i, y in delivered)


def test_file_list_labels_are_checked_where_read(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(jpeg_bytes(24, 20, seed=i))
    (tmp_path / "neg.csv").write_text("0.jpg,0\n1.jpg,-5\n")
    with pytest.raises(ValueError, match=r"neg\.csv:2: label must be >= 0, got -5"):
        filelist_source(tmp_path / "neg.csv")
    (tmp_path / "huge.csv").write_text("0.jpg,0\n1.jpg,100000000000000000000\n")
    with pytest.raises(ValueError, match=r"huge\.csv:2: label 100000000000000000000 does not fit in int64"):
        filelist_source(tmp_path / "huge.csv")
    (tmp_path / "ok.csv").write_text("0.jpg,0\n1.jpg,7\n2.jpg,1\n")
    with ImageLoader(tmp_path / "ok.csv", num_classes=5, on_error="skip", **KW) as loader:
        assert sorted(y for _, ys in loader for y in ys.tolist()) == [0, 1]  # validation: 1.jpg left out
        (path, reason), = loader.stats["skipped"]
    assert path.endswith("1.jpg") and "label 7 is not below num_classes=5" in reason


def test_num_classes_is_checked_at_construction():
    with pytest.raises(ValueError, match="num_classes must be an integer >= 1 or None, got 0"):
        ImageLoader(FileSource(["x.jpg"], [0]), num_classes=0, device="cpu")


# ---- state ---------------------------------------------------------------------------------------


@pytest.fixture()
def two_datasets(tmp_path):
    """Two folders of 12 JPEGs each, same size, other files."""
    a = _folder(tmp_path / "a", [f"{i:02d}.jpg" for i in range(12)])
    b = _folder(tmp_path / "b", [f"x{i:02d}.jpg" for i in range(12)])
    return a, b


def _state_after_one_batch(root, **kw):
    with ImageLoader(root, **dict(KW, train=True, **kw)) as loader:
        next(iter(loader))
        return loader.state_dict()


def test_a_state_saved_over_the_same_files_labelled_otherwise_is_refused(tmp_path):
    """The source's digest covers the labels, not only the paths: a file list that names the same 12 files
    with two labels swapped is another dataset, and its state is refused."""
    _folder(tmp_path, [f"{i:02d}.jpg" for i in range(12)])
    labels = [i % 3 for i in range(12)]
    (tmp_path / "list.csv").write_text("".join(f"c/{i:02d}.jpg,{y}\n" for i, y in enumerate(labels)))
    state = _state_after_one_batch(tmp_path / "list.csv")
    labels[0], labels[1] = labels[1], labels[0]
    (tmp_path / "list.csv").write_text("".join(f"c/{i:02d}.jpg,{y}\n" for i, y in enumerate(labels)))
    with ImageLoader(tmp_path / "list.csv", **dict(KW, train=True)) as relabelled:
        with pytest.raises(ValueError, match="saved over another source: 12 samples"):
            relabelled.load_state_dict(state)
        assert relabelled.sampler.position == 0 and relabelled.sampler.start == 0  # nothing taken from it


def test_a_state_saved_over_another_dataset_is_refused(two_datasets):
    a, b = two_datasets
    state = _state_after_one_batch(a)
    assert state["version"] == 1 and state["source"]["samples"] == 12
    with ImageLoader(b, **dict(KW, train=True)) as other:
        with pytest.raises(ValueError, match=r"saved over another source: 12 samples, digest '[0-9a-f]+'; this "
                                             r"loader's source has 12 samples, digest"):
            other.load_state_dict(state)
        assert other.sampler.position == 0 and other.sampler.start == 0  # nothing taken from it
    with ImageLoader(a, **dict(KW, train=True)) as same:
        same.load_state_dict(state)
        assert len([i for _ in same for i in same.batch_indices]) == 8
    moved = shutil.copytree(a, a.parent / "copied" / "elsewhere")  # as to a node's local disk
    with ImageLoader(moved, **dict(KW, train=True)) as copy:
        copy.load_state_dict(state)
        assert len([i for _ in copy for i in copy.batch_indices]) == 8


@pytest.mark.parametrize("change, message", [
    (lambda s: {}, r"lacks 'sampler'"),
    (lambda s: {"version": 1, "sampler": s["sampler"]}, r"lacks 'source'"),
    (lambda s: {**s, "version": 7}, r"format version 7; this gpufeed reads versions up to 1: .*newer gpufeed"),
    (lambda s: {**s, "version": "1"}, r"'version'\] must be an integer >= 0, got '1'"),
    (lambda s: {**s, "extra": 1}, r"keys this gpufeed does not know: 'extra'"),
    (lambda s: {**s, "image_size": "16"}, r"\['image_size'\] must be an integer, got '16'"),
    (lambda s: {**s, "sampler": {**s["sampler"], "offset": "4"}}, r"\['sampler'\]\['offset'\] must be an integer, got '4'"),
    (lambda s: {**s, "sampler": {k: v for k, v in s["sampler"].items() if k != "epoch"}}, r"\['sampler'\] lacks 'epoch'"),
    (lambda s: {**s, "sampler": [1, 2]}, r"\['sampler'\] must be a dict, got \[1, 2\]"),
    (lambda s: [s], r"state_dict must be a dict"),
])
def test_malformed_states_raise_value_errors_naming_what_is_wrong(two_datasets, change, message):
    a, _ = two_datasets
    state = _state_after_one_batch(a)
    with ImageLoader(a, **dict(KW, train=True)) as loader:
        with pytest.raises(ValueError, match=message):
            loader.load_state_dict(change(state))


def test_loading_another_seeds_state_says_so_and_goes_on_in_its_order(two_datasets, caplog):
    a, _ = two_datasets
    state = _state_after_one_batch(a, seed=3)
    with ImageLoader(a, **dict(KW, train=True, seed=3)) as ref:
        ref.load_state_dict(state)
        expected = [i for _ in ref for i in ref.batch_indices]
    with caplog.at_level(logging.WARNING, logger="gpufeed"), ImageLoader(a, **dict(KW, train=True)) as loader:
        loader.load_state_dict(state)
        assert [i for _ in loader for i in loader.batch_indices] == expected
    assert any("saved with seed=3, this loader was made with seed=0" in r.getMessage() for r in caplog.records)


# ---- reads that never return, files too large ------------------------------------------------------


def test_default_deadlines_are_finite():
    loader = ImageLoader(FileSource(["x.jpg"], [0]), device="cpu", batch_size=1)
    assert loader.errors.sample_timeout == 300 and loader.errors.batch_timeout == 600
    assert loader.errors.max_bytes == 256 << 20


def test_a_fifo_named_like_an_image_fails_at_once_under_the_defaults(tmp_path):
    """A read that would never return (a FIFO no one writes to) under the default settings: refused when
    opened, naming it, and under skip the good samples delivered."""
    _folder(tmp_path, [f"{i}.jpg" for i in range(5)])
    os.mkfifo(tmp_path / "c" / "stuck.jpg")
    with ImageLoader(tmp_path, batch_size=3, image_size=16, device="cpu", num_workers=2) as loader:
        with pytest.raises(WorkerError, match=r"stuck\.jpg.*not a regular file \(a FIFO\)"):
            list(loader)
    with ImageLoader(tmp_path, on_error="skip", **KW) as loader:
        assert len([i for _ in loader for i in loader.batch_indices]) == 5  # validation: the FIFO left out
        assert [os.path.basename(p) for p, _ in loader.stats["skipped"]] == ["stuck.jpg"]


def test_a_sparse_3_gb_jpg_is_refused_unread_naming_it(tmp_path):
    _folder(tmp_path, [f"{i}.jpg" for i in range(5)])
    with open(tmp_path / "c" / "huge.jpg", "wb") as f:
        f.write(b"\xff\xd8\xff")
        f.truncate(3 << 30)  # sparse: no disk used, but a read of it would fill 3 GB of memory
    with ImageLoader(tmp_path, on_error="skip", **KW) as loader:
        delivered = [i for _ in loader for i in loader.batch_indices]
        (path, reason), = loader.stats["skipped"]
    assert len(delivered) == 5 and path.endswith("huge.jpg")  # validation: the sparse file left out
    assert f"{3 << 30} bytes, over max_bytes={256 << 20}: refused unread" in reason
    with ImageLoader(tmp_path, **KW) as loader:
        with pytest.raises(WorkerError, match=r"huge\.jpg.*over max_bytes"):
            list(loader)


def test_a_batch_past_batch_timeout_names_the_worker_and_the_samples_in_flight(tmp_path):
    """A batch of 3 over one worker (chunks of 2 and 1), each read taking 1.5 s: not done 2 s after it was
    asked for, its worker on one of its first two samples and its last chunk not taken yet."""
    from .slow_source import SleepySource

    root = _folder(tmp_path, [f"{i}.jpg" for i in range(3)])
    paths = sorted(str(p) for p in (root / "c").iterdir())
    with ImageLoader(SleepySource(paths, [0] * 3), batch_size=3, image_size=16, device="cpu", num_workers=1,
                     train=False, batch_timeout=2.0) as loader:
        with pytest.raises(WorkerError, match=r"not done within batch_timeout=2\.0s \(\d+ s\): worker 0 \(pid \d+\) "
                                              r"on '.*c/[01]\.jpg' for \d+ s; not taken by any worker yet: 1 "
                                              r"sample\(s\), '.*c/2\.jpg'"):
            list(loader)


# ---- outages under skip --------------------------------------------------------------------------


def test_an_all_broken_folder_under_skip_raises_naming_the_first_failures(tmp_path):
    _folder(tmp_path, [f"{i:02d}.jpg" for i in range(12)], bad={f"{i:02d}.jpg" for i in range(12)})
    with ImageLoader(tmp_path, on_error="skip", **KW) as loader:
        with pytest.raises(WorkerError, match=r"on_error='skip' gave up: \d+ of this rank's 12 samples of epoch 0 "
                                              r"failed .*an outage.*The first failures: '.*/c/00\.jpg'"):
            list(loader)


def test_failures_are_counted_once_when_a_refill_loads_them_again(tmp_path):
    """Training: the first batch has no good sample, so it is filled from the next batch's entries, one of them
    bad: that file is skipped twice, counted once."""
    from gpufeed.sampling import ShardedSampler

    order = ShardedSampler(12, seed=0).full_order()  # training's order of epoch 0 (the folder's files sorted)
    bad = {f"{i:02d}.jpg" for i in order[:4] + [order[5]]}
    _folder(tmp_path, [f"{i:02d}.jpg" for i in range(12)], bad=bad)
    with ImageLoader(tmp_path, on_error="skip", **dict(KW, train=True)) as loader:
        batches = [list(loader.batch_indices) for _ in loader]
        stats = loader.stats
    # the refill: the order's entry 5 failed, its entry 4 stands in
    assert batches[0] == [order[4], order[4], order[6], order[7]] and len(batches) == 3
    assert stats["skipped_count"] == 5 == len(stats["skipped"])
    assert sorted(os.path.basename(p) for p, _ in stats["skipped"]) == sorted(bad)


@pytest.mark.gpu
def test_the_cuda_consumer_waits_at_most_its_timeout_naming_the_prefetch_threads_frame():
    from gpufeed.transfer import Prefetcher

    def stuck():
        yield torch.zeros(2)
        time.sleep(5)  # stuck well past the 1 s timeout
        yield torch.zeros(2)

    batches = iter(Prefetcher(stuck(), "cuda", timeout=1.0))
    next(batches)
    with pytest.raises(TimeoutError, match=r"no batch within 1 s; the prefetch thread is at .*stuck"):
        next(batches)
