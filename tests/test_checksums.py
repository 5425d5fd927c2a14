"""``verify_checksums=True``: the loader checks each shard of a `gpufeed shards` folder against its manifest's
sha256 as it reads it, locally (tar and Parquet) and from S3 (moto's server, real s3fs). A shard changed in
place, its size kept, is named with the way out; under on_error="skip" exactly its samples are skipped and
counted, the others delivered with their own labels."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from gpufeed import ImageLoader, WorkerError
from gpufeed.shards import ShardOptions, ShardSize, write_shards
from gpufeed.sources import create_source

from .servers import S3Server

KW = dict(batch_size=5, image_size=16, device="cpu", num_workers=2, train=False, drop_last=False)
OPTIONS = dict(max_side=48, shard_size=ShardSize(16), workers=1)  # 40 samples: shards of 16, 16 and 8


def _forge_label(shard: Path) -> None:
    """One ``.cls`` member of ``shard`` given another digit, in place: the size stays."""
    data = shard.read_bytes()
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".cls"))
    where = member.offset_data
    shard.write_bytes(data[:where] + (b"9" if data[where:where + 1] != b"9" else b"8") + data[where + 1:])


def _delivered(loader) -> tuple[list[int], list[int]]:
    indices, labels = [], []
    for _, y in loader:
        indices += loader.batch_indices
        labels += y.tolist()
    return indices, labels


@pytest.fixture(scope="module")
def tar_shards(synth_root, tmp_path_factory):
    dest = tmp_path_factory.mktemp("tar") / "out"
    write_shards(synth_root, dest, ShardOptions(**OPTIONS))
    return dest


def test_unchanged_shards_pass_and_a_changed_one_is_named_with_the_way_out(tar_shards, tmp_path):
    reference = create_source(tar_shards)
    with ImageLoader(tar_shards, verify_checksums=True, **KW) as loader:
        indices, labels = _delivered(loader)
    assert sorted(indices) == list(range(40)) and labels == [reference.label(i) for i in indices]

    changed = tmp_path / "out"
    changed.mkdir()
    for p in tar_shards.iterdir():
        (changed / p.name).write_bytes(p.read_bytes())
    _forge_label(changed / "shard-000001.tar")
    with ImageLoader(changed, **KW) as loader:  # off by default: read as it is, the forged label included
        assert sorted(_delivered(loader)[0]) == list(range(40))
    with pytest.raises(WorkerError, match=r"shard-000001.tar: its sha256 is not the one .*manifest.json lists .*"
                                      r"gpufeed shards --verify DEST.* verify_checksums=False"):
        with ImageLoader(changed, verify_checksums=True, **KW) as loader:
            _delivered(loader)


def test_under_skip_exactly_the_changed_shards_samples_are_skipped_and_counted(tar_shards, tmp_path):
    changed = tmp_path / "out"
    changed.mkdir()
    for p in tar_shards.iterdir():
        (changed / p.name).write_bytes(p.read_bytes())
    _forge_label(changed / "shard-000001.tar")
    source = create_source(changed)
    in_changed = {i for i in range(len(source)) if "shard-000001.tar:" in source.path(i)}
    assert len(in_changed) == 16
    with ImageLoader(changed, verify_checksums=True, on_error="skip", **KW) as loader:
        indices, labels = _delivered(loader)
        stats = loader.stats
    assert sorted(indices) == sorted(set(range(40)) - in_changed)
    assert labels == [source.label(i) for i in indices]  # the others keep their own labels
    assert stats["skipped_count"] == 16
    assert all("shard-000001.tar" in path and "sha256" in why for path, why in stats["skipped"])


def test_each_shard_is_hashed_once_however_many_workers_read_it(tar_shards):
    """Two workers read samples of every shard over two epochs: each shard is hashed once on this machine (the
    first process to open it hashes it, the others take its answer), as loader.stats["shards_hashed"] counts."""
    with ImageLoader(tar_shards, verify_checksums=True, **KW) as loader:
        for _ in range(2):
            assert sorted(_delivered(loader)[0]) == list(range(40))
        stats = loader.stats
        hashed = loader.source.checksums.hashed()
    assert stats["shards_hashed"] == 3 and hashed == {f"shard-{s:06d}.tar": 1 for s in range(3)}
    with ImageLoader(tar_shards, **KW) as loader:
        assert loader.stats["shards_hashed"] is None  # not asked for


def test_processes_sharing_answers_hash_a_file_once_and_a_changed_one_again(tmp_path):
    """Checksums shared through a folder (``shared``), pickled as the workers get them: the second process
    takes the first one's answer for the same file; a rewrite of that file is hashed again and refused,
    naming the shard and the way out."""
    import hashlib
    import os
    import pickle

    from gpufeed.sources.checksums import ShardChecksums

    data = bytes(range(256)) * 4096
    shard = tmp_path / "shard-000000.tar"
    shard.write_bytes(data)
    folder = tmp_path / "answers"
    folder.mkdir(mode=0o700)
    checks = ShardChecksums({shard.name: hashlib.sha256(data).hexdigest()},
                            str(tmp_path / "manifest.json")).shared(str(folder))
    workers = [pickle.loads(pickle.dumps(checks)) for _ in range(3)]
    for worker in workers:
        with open(shard, "rb") as f:
            worker.check(str(shard), f.fileno())
    assert checks.hashed() == {shard.name: 1}
    shard.write_bytes(data[:-1] + b"x")
    for worker in workers:
        with open(shard, "rb") as f, pytest.raises(OSError, match=r"shard-000000\.tar: its sha256 is not the one .*"
                                                                  r"verify_checksums=False"):
            worker.check(str(shard), f.fileno())
    assert checks.hashed() == {shard.name: 2}


def test_parquet_shards_are_verified_too(synth_root, tmp_path):
    pytest.importorskip("pyarrow")
    dest = tmp_path / "pq"
    manifest = write_shards(synth_root, dest, ShardOptions(**OPTIONS, format="parquet"))
    first = dest / manifest["shards"][0]["name"]
    data = bytearray(first.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside the image bytes: pyarrow alone would not see it
    first.write_bytes(bytes(data))
    with ImageLoader(dest, verify_checksums=True, on_error="skip", **KW) as loader:
        indices, _ = _delivered(loader)
        stats = loader.stats
    assert len(indices) == 40 - manifest["shards"][0]["samples"] and stats["skipped_count"] == 40 - len(indices)
    assert all(manifest["shards"][0]["name"] in path and "sha256" in why for path, why in stats["skipped"])


def test_shards_read_from_s3_are_verified_after_their_fetch(synth_root, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))
    server = S3Server()
    try:
        server.bucket("verified")  # moto's buckets live in this process: a name no other test uses
        local = tmp_path / "local"
        write_shards(synth_root, local, ShardOptions(**OPTIONS))
        _forge_label(local / "shard-000002.tar")
        for p in local.iterdir():
            server.put("verified", f"train/{p.name}", p.read_bytes())
        with ImageLoader("s3://verified/train", storage_options=server.storage_options, verify_checksums=True,
                         on_error="skip", **KW) as loader:
            indices, _ = _delivered(loader)
            stats = loader.stats
        assert len(indices) == 32 and stats["skipped_count"] == 8, stats["skipped"]
        assert stats["shards_hashed"] == 3  # each copy once, by the fetch threads or the first worker to open it
        assert all("s3://verified/train/shard-000002.tar" in path for path, _ in stats["skipped"])
    finally:
        server.stop()


def test_a_folder_without_a_manifest_cannot_be_verified(synth_root):
    with pytest.raises(ValueError, match=r"verify_checksums=True checks shards against the manifest.json .* has "
                                         r"none: give the folder `gpufeed shards` wrote, or verify_checksums=False"):
        ImageLoader(synth_root, verify_checksums=True, **KW)
    with pytest.raises(ValueError, match=r"verify_checksums must be True or False, got 'yes'"):
        ImageLoader(synth_root, verify_checksums="yes", **KW)


def test_a_change_anywhere_in_a_shard_of_several_megabytes_is_found(tmp_path):
    """The whole file is hashed, not its first read: a byte changed at 2.5 MB of a 3 MB shard is found, and a
    shard the manifest does not list is named too."""
    import hashlib
    import os

    from gpufeed.sources.checksums import ShardChecksums

    data = bytes(range(256)) * (3 * 4096)
    shard = tmp_path / "shard-000000.tar"
    shard.write_bytes(data)
    checks = ShardChecksums({"shard-000000.tar": hashlib.sha256(data).hexdigest()}, str(tmp_path / "manifest.json"))
    fd = os.open(shard, os.O_RDONLY)
    try:
        checks.check(str(shard), fd)  # as written
    finally:
        os.close(fd)
    changed = bytearray(data)
    changed[2_500_000] ^= 1
    shard.write_bytes(bytes(changed))
    for name, message in (("shard-000000.tar", "its sha256 is not the one"), ("other.tar", "not listed with a sha256")):
        path = shard.with_name(name)
        path.write_bytes(bytes(changed))
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(OSError, match=f"{name}: {message}"):
                checks.check(str(path), fd)
        finally:
            os.close(fd)


def test_a_shard_changed_in_place_with_its_mtime_put_back_is_hashed_again(tmp_path):
    """An answer is kept per file, but a rewrite of the same length whose mtime is set back (`touch -r`,
    `rsync --inplace -t`) is not taken for the file already checked."""
    import hashlib
    import os
    import time

    from gpufeed.sources.checksums import ShardChecksums

    data = bytes(range(256)) * 4096
    shard = tmp_path / "shard-000000.tar"
    shard.write_bytes(data)
    checks = ShardChecksums({shard.name: hashlib.sha256(data).hexdigest()}, str(tmp_path / "manifest.json"))
    st = os.stat(shard)
    with open(shard, "rb") as f:
        checks.check(str(shard), f.fileno())  # as written: remembered
    time.sleep(0.01)  # a later ctime on file systems that keep it coarse
    with open(shard, "r+b") as f:  # the same inode and length, one byte changed
        f.seek(1000)
        f.write(bytes([data[1000] ^ 1]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(shard).st_mtime_ns == st.st_mtime_ns and os.stat(shard).st_ino == st.st_ino
    with open(shard, "rb") as f, pytest.raises(OSError, match="its sha256 is not the one"):
        checks.check(str(shard), f.fileno())


def test_a_manifest_that_is_a_fifo_or_too_large_is_refused_naming_it_not_waited_on(tmp_path, monkeypatch):
    """A local manifest.json is read only as a regular file under the cap: a FIFO there (which a plain open
    would wait on forever) and an oversized file each raise naming it and the way out."""
    import os

    from gpufeed.sources import manifest

    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "manifest.json")
    with pytest.raises(OSError, match=r"manifest.json: the shard manifest is there but cannot be read \(not a "
                                      r"regular file\).*move it away"):
        manifest.read_manifest(tmp_path / "fifo")
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "manifest.json").write_bytes(b" " * 2048)
    monkeypatch.setattr(manifest, "MANIFEST_BYTES", 1024)
    with pytest.raises(OSError, match=r"2048 bytes, over the cap of 1024"):
        manifest.read_manifest(tmp_path / "big")
    assert manifest.read_manifest(tmp_path / "none") is None  # no manifest: shards read without one


def _one_shard(tmp_path: Path, folder: str | None = None):
    """A shard and its checksums shared through ``folder`` (None: a fresh private one), as a worker gets them."""
    import hashlib
    import pickle

    from gpufeed.sources.checksums import ShardChecksums

    data = bytes(range(256)) * 64
    shard = tmp_path / "shard-000000.tar"
    shard.write_bytes(data)
    checks = ShardChecksums({shard.name: hashlib.sha256(data).hexdigest()}, str(tmp_path / "manifest.json"))
    checks = checks.shared(folder)
    return shard, checks, pickle.loads(pickle.dumps(checks))


def test_a_shared_folder_that_fails_stops_the_sharing_not_the_check(tmp_path):
    """The folder the answers are shared through is gone (a temporary-files cleaner, a deleted spool): a shard
    as written still passes, hashed by the process reading it, and a changed one is still refused by name."""
    import shutil

    shard, checks, worker = _one_shard(tmp_path)
    shutil.rmtree(checks.folder)
    with open(shard, "rb") as f:
        worker.check(str(shard), f.fileno())
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with open(shard, "rb") as f, pytest.raises(OSError, match=r"shard-000000\.tar: its sha256 is not the one"):
        worker.check(str(shard), f.fileno())


def test_a_shard_lock_held_for_ever_is_waited_on_until_its_deadline_only(tmp_path):
    """A process that holds a shard's lock and never lets go (a child forked while its parent hashed keeps the
    lock): another process reading the shard waits a few seconds at most (LOCK_WAIT), then hashes it itself."""
    import fcntl
    import os
    import threading
    import time

    shard, checks, worker = _one_shard(tmp_path)
    with open(shard, "rb") as f:
        checks.check(str(shard), f.fileno())  # the shard's lock file is made
    shard.write_bytes(shard.read_bytes())  # the same bytes, a new ctime: hashed again, under the lock
    held = [os.open(os.path.join(checks.folder, n), os.O_RDWR) for n in os.listdir(checks.folder)
            if n.endswith(".lock")]
    assert held
    for fd in held:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: the same process conflicts with it as another would
    outcome: list = []

    def read() -> None:
        with open(shard, "rb") as f:
            try:
                outcome.append(worker.answer(str(shard), f.fileno()))
            except BaseException as e:
                outcome.append(e)

    try:
        start = time.monotonic()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(20)
        waited = time.monotonic() - start
        assert not reader.is_alive(), f"still waiting on the lock after {waited:.1f} s"
    finally:
        for fd in held:
            os.close(fd)
    assert outcome == [None] and 1 <= waited < 15


def test_a_second_loader_over_the_same_source_leaves_the_first_ones_answers_folder(tar_shards):
    """Two loaders over one Source object (training, then validation), the first mid-epoch when the second is
    made: the first still reads every sample, through the folder both now share."""
    import gc

    source = create_source(tar_shards)
    first = ImageLoader(source, verify_checksums=True, **KW)
    try:
        batches = iter(first)
        next(batches)
        indices = list(first.batch_indices)
        second = ImageLoader(source, verify_checksums=True, **KW)
        gc.collect()
        for _ in batches:
            indices += first.batch_indices
        assert sorted(indices) == list(range(40))
        assert sorted(_delivered(second)[0]) == list(range(40))
        second.close()
    finally:
        first.close()


def test_each_loader_counts_its_own_hashings_in_a_folder_it_shares(synth_root, tmp_path):
    """Two loaders over one Parquet Source, one after the other, share its spool's folder: the second, reading
    the files after a rewrite (a new ctime each: hashed again), counts its own three hashings, not the first
    loader's too."""
    pytest.importorskip("pyarrow")
    dest = tmp_path / "pq"
    manifest = write_shards(synth_root, dest, ShardOptions(**OPTIONS, format="parquet"))
    source = create_source(dest)
    with ImageLoader(source, verify_checksums=True, **KW) as first:
        assert sorted(_delivered(first)[0]) == list(range(40))
        assert first.stats["shards_hashed"] == len(manifest["shards"]) == 3
    for entry in manifest["shards"]:
        path = dest / entry["name"]
        path.write_bytes(path.read_bytes())
    with ImageLoader(source, verify_checksums=True, **KW) as second:
        assert sorted(_delivered(second)[0]) == list(range(40))
        assert second.stats["shards_hashed"] == 3


def _check_at_once(pickled: bytes, shard: str, barrier) -> None:
    """A worker process: its copy of the checksums, then the shard checked the moment every worker is ready."""
    import os
    import pickle

    checks = pickle.loads(pickled)
    fd = os.open(shard, os.O_RDONLY)
    barrier.wait(30)
    checks.check(shard, fd)


def test_processes_opening_a_shard_at_once_hash_it_once(tmp_path):
    """Four processes, released together by a barrier, open the same 32 MB shard (tens of milliseconds to hash,
    so without its lock each would hash it): one hashes, the others wait for it and take its answer."""
    import hashlib
    import multiprocessing
    import pickle

    from gpufeed.sources.checksums import ShardChecksums

    data = hashlib.sha256(b"seed").digest() * (1 << 20)
    shard = tmp_path / "shard-000000.tar"
    shard.write_bytes(data)
    checks = ShardChecksums({shard.name: hashlib.sha256(data).hexdigest()}, str(tmp_path / "manifest.json")).shared()
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(4)
    workers = [context.Process(target=_check_at_once, args=(pickle.dumps(checks), str(shard), barrier))
               for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [w.exitcode for w in workers] == [0] * 4
    assert checks.hashed() == {shard.name: 1}


def test_each_process_keeps_its_newest_answers_only(tmp_path):
    """A copy fetched again every epoch is a new file each time: a long run's answers do not pile up in memory
    (the newest ANSWERS_KEPT are kept)."""
    import hashlib

    from gpufeed.sources.checksums import ANSWERS_KEPT, ShardChecksums

    shard = tmp_path / "shard-000000.tar"
    checks = ShardChecksums({shard.name: hashlib.sha256(b"x").hexdigest()}, str(tmp_path / "manifest.json"))
    for size in range(1, ANSWERS_KEPT + 50):
        shard.write_bytes(b"x" * size)  # another size: another file to the checks
        with open(shard, "rb") as f:
            checks.answer(str(shard), f.fileno())
    assert len(checks._answers) == ANSWERS_KEPT
