"""Data where it lives: tar shards on an S3 server (moto, through s3fs) and an HTTP server (the standard
library's), started here; exactly once across ranks and workers, exact resume, retries, and failures that
name the URL."""

from __future__ import annotations

import collections
import os
import re
import threading
import time

import pytest
import torch

from gpufeed import ImageLoader
from gpufeed.sampling import ShardedSampler
from gpufeed.sources import RetryPolicy, create_source, remote_tar_source, tar_source
from gpufeed.sources.urls import expand_braces

from gpufeed.synth import tar_shards

from .servers import FAST, HttpServer, S3Server, own_index_cache, shards_over_http, src  # noqa: F401 (fixtures)

KW = dict(batch_size=4, image_size=16, device="cpu", seed=3)


def _server_with_shards(src) -> S3Server:
    """8 WebDataset shards of 5 samples at s3://data/train/ (sample i in shard i // 5)."""
    server = S3Server()
    server.bucket("data")
    for s, data in enumerate(tar_shards(src, 5)):
        server.put("data", f"train/shard-{s:03d}.tar", data)
    return server


@pytest.fixture(scope="module")
def s3(src):
    server = _server_with_shards(src)
    yield server
    server.stop()


@pytest.fixture()
def fresh_s3(src):
    """The same shards on a server of this test's own, which it may stop."""
    server = _server_with_shards(src)
    yield server
    server.stop()


@pytest.fixture()
def http(tmp_path, src):
    """The shards as files served over HTTP: {url}/shard-000.tar ... shard-007.tar."""
    server = shards_over_http(tmp_path / "www", src)
    yield server
    server.stop()


def _epoch(loader, stop=None):
    """(source indices, labels, images) of one pass, batch by batch."""
    out = []
    for k, (images, labels) in enumerate(loader):
        out.append((list(loader.batch_indices), labels.tolist(), images))
        if stop is not None and k + 1 == stop:
            break
    return out


def _ids(batches):
    return [i for b in batches for i in b[0]]


def test_brace_ranges_expand_as_webdataset_writes_them():
    assert expand_braces("s3://b/shard-{000008..000011}.tar") == [f"s3://b/shard-{i:06d}.tar" for i in range(8, 12)]
    assert expand_braces("a{1..2}-{0..1}") == ["a1-0", "a1-1", "a2-0", "a2-1"]
    with pytest.raises(ValueError, match="backwards"):
        expand_braces("x{3..1}")


@pytest.mark.parametrize("url, direct", [("s3://data/train/", True), ("s3://data/train/shard-{000..007}.tar", True),
                                         ("s3://data/train/", False)])
def test_s3_shards_give_the_folder_samples(s3, src, url, direct):
    """Through a presigned GET (direct) and through s3fs alone."""
    remote = remote_tar_source(url, storage_options=s3.storage_options, direct_get=direct)
    assert len(remote) == len(src) == 40 and remote.groups == (5,) * 8
    for i in range(40):
        assert remote.read(i) == src.read(i) and remote.label(i) == src.label(i)
    assert remote.path(17) == "s3://data/train/shard-003.tar:000017.jpg"


def test_loader_from_s3_equals_loader_from_local_shards(s3, src, tmp_path):
    local = tmp_path / "shards"
    local.mkdir()
    for s, data in enumerate(tar_shards(src, 5)):
        (local / f"shard-{s:03d}.tar").write_bytes(data)
    kw = dict(KW, train=False, num_workers=2)
    with ImageLoader("s3://data/train/", storage_options=s3.storage_options, **kw) as a, ImageLoader(local, **kw) as b:
        ea, eb = _epoch(a), _epoch(b)
    assert len(ea) == len(eb) == 10
    for (ia, ya, xa), (ib, yb, xb) in zip(ea, eb, strict=True):
        assert ia == ib and ya == yb and torch.equal(xa, xb)


def test_exactly_once_across_three_ranks_and_two_workers_from_s3_each_rank_fetching_its_own_shards(s3, src):
    """40 samples in 8 shards over 3 ranks x 2 workers: each sample once per epoch (DistributedSampler's
    padding of 2 aside), with its own label, and a new order the next epoch. Each rank's loader (its own
    access key, so the server tells its GETs apart) reads 3 to 5 shards (its run's 3 or 4, and one for a
    padding sample), not all 8, and fetches only those, each once, and the first ones of its next epoch's
    own (started at this one's end)."""
    before = len(s3.gets("test", ".tar"))
    remote_tar_source("s3://data/train/", storage_options=s3.storage_options)  # counts into the index cache
    firsts, checked = [], 0
    for epoch in range(2):
        delivered = []
        for rank in range(3):
            key = f"rank{rank}-epoch{epoch}"
            with ImageLoader("s3://data/train/", storage_options=dict(s3.storage_options, key=key), num_workers=2,
                             rank=rank, world_size=3, drop_last=False, **KW) as loader:
                loader.set_epoch(epoch)
                ids = []
                for batch, labels, _ in _epoch(loader):
                    assert labels == [src.label(i) for i in batch]
                    ids += batch
                    if rank == 0 and len(firsts) == epoch:
                        firsts.append(batch)
            delivered += ids
            mine = {i // 5 for i in ids}
            after = ShardedSampler(40, groups=(5,) * 8, seed=KW["seed"], rank=rank, world_size=3, epoch=epoch + 1)
            nxt = {i // 5 for i in after.epoch_indices()}
            assert len(ids) == 14 and 3 <= len(mine) <= 5 and 3 <= len(nxt) <= 5, (mine, nxt)
            fetched = collections.Counter(int(p[-7:-4]) for p in s3.gets(key, ".tar"))
            assert mine <= set(fetched) <= mine | nxt and sum(fetched.values()) <= len(mine) + len(nxt), fetched
            checked += 1
        counts = collections.Counter(delivered)
        assert set(counts) == set(range(40)) and sum(counts.values()) == 42 and max(counts.values()) == 2
    assert firsts[0] != firsts[1] and checked == 6
    assert len(s3.gets("test", ".tar")) - before == 8  # this test's default key only indexed each shard once


def test_mid_epoch_resume_from_s3_is_exact(s3):
    kw = dict(KW, storage_options=s3.storage_options, num_workers=2)
    with ImageLoader("s3://data/train/", **kw) as loader:
        loader.set_epoch(1)
        whole = _epoch(loader)
    with ImageLoader("s3://data/train/", **kw) as loader:
        loader.set_epoch(1)
        head = _epoch(loader, stop=3)
        state = loader.state_dict()
    with ImageLoader("s3://data/train/", **dict(kw, num_workers=1)) as loader:
        loader.load_state_dict(state)
        tail = _epoch(loader)
    assert len(whole) == 10 and len(head) == 3 and len(tail) == 7
    for (ia, ya, xa), (ib, yb, xb) in zip(whole, head + tail, strict=True):
        assert ia == ib and ya == yb and torch.equal(xa, xb)


def test_elastic_resume_from_s3_continues_the_order_made_for_three_ranks(s3):
    """Three ranks deliver a batch each and save; two ranks resume: exactly the samples no rank delivered
    (the 40 - 12 left split evenly, no padding), then a next epoch dealt to two ranks, each sample once."""
    kw = dict(KW, storage_options=s3.storage_options, num_workers=1, drop_last=False)
    delivered = []
    for rank in range(3):
        with ImageLoader("s3://data/train/", rank=rank, world_size=3, **kw) as loader:
            loader.set_epoch(1)
            delivered += _ids(_epoch(loader, stop=1))
            state = loader.state_dict()
    assert state["sampler"]["offset"] == 12 and state["sampler"]["order_world_size"] == 3
    after = []
    for rank in range(2):
        with ImageLoader("s3://data/train/", rank=rank, world_size=2, **kw) as loader:
            loader.load_state_dict(state)
            delivered += _ids(_epoch(loader))
            after += _ids(_epoch(loader))  # epoch 2
            assert loader.state_dict()["sampler"]["order_world_size"] == 2
    assert sorted(delivered) == list(range(40)) and sorted(after) == list(range(40))


def test_server_restart_mid_epoch_under_skip_loses_nothing_unreported(fresh_s3):
    """The server goes away after the first batch and is back a second later: the fetches wait it out
    (retries with backoff), so the epoch delivers every sample, and reports what it could not."""
    source = remote_tar_source("s3://data/train/", storage_options=fresh_s3.storage_options, readahead=1, window=1,
                               retry=RetryPolicy(attempts=10, backoff=0.1, max_wait=0.5))
    with ImageLoader(source, num_workers=2, on_error="skip", batch_size=5, image_size=16, device="cpu") as loader:
        batches = iter(loader)
        next(batches)
        delivered = list(loader.batch_indices)
        fresh_s3.stop()
        stopped = time.monotonic()
        threading.Timer(1.0, fresh_s3.start).start()
        for _ in batches:
            delivered += loader.batch_indices
        waited = time.monotonic() - stopped
        reported = {p for p, _ in loader.stats["skipped"]}
        assert loader.stats["skipped_count"] == len(reported)
    assert waited > 0.9  # the rest of the epoch did need the server
    lost = set(range(40)) - set(delivered)
    assert {f"{i:06d}.jpg" for i in lost} == {p.rsplit(":", 1)[-1] for p in reported}
    assert not lost and not reported  # one second down is within the retries


def test_server_gone_under_raise_names_the_url(fresh_s3):
    source = remote_tar_source("s3://data/train/", storage_options=fresh_s3.storage_options, readahead=1, window=1,
                               retry=FAST)
    with ImageLoader(source, num_workers=2, batch_size=5, image_size=16, device="cpu") as loader:
        batches = iter(loader)
        next(batches)
        fresh_s3.stop()
        with pytest.raises(RuntimeError, match=r"s3://data/train/shard-00\d\.tar.*cannot fetch the file after 2 attempts"):
            for _ in batches:
                pass


def test_https_brace_range_with_declared_counts_starts_without_requests_and_reads_each_shard_once(http, src):
    url = f"{http.url}/shard-{{000..007}}.tar"
    source = remote_tar_source(url, samples_per_shard=5)
    assert http.requests == []  # nothing listed or opened before the first batch is asked for
    with ImageLoader(source, num_workers=2, **KW) as loader:
        for _ in range(2):
            for ids, labels, _ in _epoch(loader):
                assert labels == [src.label(i) for i in ids]
    # whole-shard GETs, at most one per shard and epoch (the third: the next epoch's early start), never a
    # request per sample
    counts = collections.Counter(http.requests)
    assert set(counts) == {f"/shard-{s:03d}.tar" for s in range(8)} and max(counts.values()) <= 3
    assert set(http.ranges) == {None}


def test_index_cache_makes_the_next_start_free(http):
    url = f"{http.url}/shard-{{000..007}}.tar"
    assert len(remote_tar_source(url)) == 40  # counts unknown: each shard fetched and indexed once
    assert sorted(http.requests) == [f"/shard-{s:03d}.tar" for s in range(8)]
    again = remote_tar_source(url)
    assert len(again) == 40 and again.groups == (5,) * 8 and len(http.requests) == 8


def test_503s_are_retried_with_backoff(http, src):
    http.fail("/shard-003.tar", 2)
    source = remote_tar_source(f"{http.url}/shard-{{000..007}}.tar", samples_per_shard=5,
                               retry=RetryPolicy(attempts=3, backoff=0.05))
    with ImageLoader(source, num_workers=2, on_error="skip", **KW) as loader:
        ids = _ids(_epoch(loader))
        assert loader.stats["skipped_count"] == 0
    assert sorted(ids) == list(range(40)) and http.failures_left("/shard-003.tar") == 0
    assert http.requests.count("/shard-003.tar") >= 3  # two 503s, then the shard


def test_503s_past_the_retries_under_raise_name_the_url(http):
    http.fail("/shard-003.tar", 100)
    source = remote_tar_source(f"{http.url}/shard-{{000..007}}.tar", samples_per_shard=5, retry=FAST)
    with ImageLoader(source, num_workers=2, **KW) as loader:
        with pytest.raises(RuntimeError, match=r"/shard-003\.tar: cannot fetch the file after 2 attempts.*503"):
            _epoch(loader)


def test_truncated_shard_under_skip_reports_the_samples_past_the_cut(http, src):
    """shard-002 (samples 10-14) cut inside its third image: samples 12-14 are skipped, each reported with the
    URL; the rest of the epoch is whole."""
    data = (http.root / "shard-002.tar").read_bytes()
    members = tar_source(http.root / "shard-002.tar")
    cut = int(members._offset[2]) + 100
    (http.root / "shard-002.tar").write_bytes(data[:cut])
    source = remote_tar_source(f"{http.url}/shard-{{000..007}}.tar", samples_per_shard=5)
    with ImageLoader(source, num_workers=2, on_error="skip", **KW) as loader:
        ids = set(_ids(_epoch(loader)))
        skipped = loader.stats["skipped"]
    assert ids == set(range(40)) - {12, 13, 14}
    assert len(skipped) == 3 and all("shard-002.tar" in p and "truncated" in r for p, r in skipped)
    with ImageLoader(source, num_workers=2, **KW) as loader:
        with pytest.raises(RuntimeError, match=r"shard-002\.tar.*sample \d missing"):
            _epoch(loader)


def test_wrong_declared_count_fails_naming_the_url(http):
    source = remote_tar_source(f"{http.url}/shard-{{000..007}}.tar", samples_per_shard=4)
    with pytest.raises(OSError, match=r"shard-000\.tar: holds 5 samples, 4 expected"):
        source.read(0)


def test_missing_shard_is_not_retried_and_names_the_url(http):
    source = remote_tar_source(f"{http.url}/shard-{{000..008}}.tar", samples_per_shard=5,
                               retry=RetryPolicy(attempts=5, backoff=1.0))
    assert source.read(0)  # shard-000 is there
    with pytest.raises(FileNotFoundError, match=r"/shard-008\.tar: cannot fetch the file"):
        source.read(42)
    assert http.requests.count("/shard-008.tar") == 1  # asked once: no retry, so none of the backoff's waits


def test_missing_filesystem_package_names_the_extra():
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"gcsfs: pip install 'gpufeed\[gcs\]'"):
            create_source("gs://bucket/train/")
    else:
        pytest.skip("gcsfs is installed here")


def test_bench_reads_a_url_and_info_lists_the_schemes(s3, tmp_path, capsys):
    import json

    from gpufeed.cli import main

    rc = main(["bench", "--data", "s3://data/train/", "--storage-options", json.dumps(s3.storage_options),
               "--batch-size", "8", "--workers", "1", "--epochs", "2", "--device", "cpu", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["pipeline"] for r in rows] == ["gpufeed (cpu decode)"]  # the ImageFolder baseline cannot read a URL
    assert [e["images"] for e in rows[0]["epochs"]] == [40, 40, 40]  # warm-up, plain, memory
    capsys.readouterr()
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"URLs s3://\s+yes, s3fs", out) and re.search(r"Parquet tables\s+yes, pyarrow", out)


def test_plain_get_where_the_url_allows_fsspec_where_options_ask(http, src):
    url = f"{http.url}/shard-{{000..007}}.tar"
    assert remote_tar_source(url, samples_per_shard=5).read(7) == src.read(7)
    assert http.agents[-1].startswith("Python-urllib")  # the standard library's GET: less CPU per byte
    with_headers = remote_tar_source(url, samples_per_shard=5, storage_options={"headers": {"X-Token": "t"}})
    assert with_headers.read(12) == src.read(12)
    assert "aiohttp" in http.agents[-1]  # options only fsspec applies: fsspec fetches


def test_plain_get_that_fails_before_it_ever_worked_hands_over_to_fsspec(http, src):
    http.fail("/shard-000.tar", 1, code=403)  # not a passing failure: this setup may need fsspec's client
    source = remote_tar_source(f"{http.url}/shard-{{000..007}}.tar", samples_per_shard=5)
    assert source.read(0) == src.read(0) and source.read(5) == src.read(5)
    assert http.agents[0].startswith("Python-urllib") and ["aiohttp" in a for a in http.agents[1:]] == [True, True]


def test_a_passing_failure_before_the_plain_get_ever_worked_is_retried_not_handed_over(http, src):
    http.fail("/shard-000.tar", 1)  # 503: retried, and the cheaper route stays
    source = remote_tar_source(f"{http.url}/shard-{{000..007}}.tar", samples_per_shard=5)
    assert source.read(0) == src.read(0) and source.read(5) == src.read(5)
    assert len(http.agents) == 3 and all(a.startswith("Python-urllib") for a in http.agents), http.agents


@pytest.mark.parametrize("fmt", ["USTAR_FORMAT", "GNU_FORMAT", "PAX_FORMAT"])
def test_member_index_matches_tarfile_and_finds_the_cut(tmp_path, fmt):
    """The header walk that indexes spooled shards gives tarfile's names, offsets and sizes (long names
    included), the .cls labels, and marks a shard cut short as incomplete."""
    import io
    import os
    import tarfile

    from gpufeed.sources.remote_tar import parse_members

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=getattr(tarfile, fmt)) as tf:
        for i in range(30):
            stem = ("d" * (120 if i % 7 == 0 else 3)) + f"/x{i}" if fmt != "USTAR_FORMAT" else f"d/x{i}"
            for name, data in ((f"{stem}.jpg", os.urandom(1000 + 37 * i)), (f"{stem}.cls", str(i % 5).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    path = tmp_path / "s.tar"
    path.write_bytes(buf.getvalue())
    with tarfile.open(path) as tf:
        expected = [(m.name, m.offset_data, m.size) for m in tf if m.name.endswith(".jpg")]
    members = parse_members(str(path))
    assert list(zip(members.names, members.offsets, members.sizes)) == expected
    assert members.complete and members.labels == [i % 5 for i in range(30)]
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    cut = parse_members(str(path))
    assert not cut.complete and 0 < len(cut.names) < 30 and cut.names == members.names[: len(cut.names)]


def test_malformed_pax_records_never_stall_the_header_walk():
    """A pax record whose length is not a number, or too short to move on, leaves the header's own name."""
    from gpufeed.sources.remote_tar import _pax_path

    assert _pax_path(b"16 path=a/b.jpg\n") == "a/b.jpg"
    assert _pax_path(b"0 path=x\n") is None and _pax_path(b"1 path=x\n") is None
    assert _pax_path(b"zz path=x\n") is None


def test_a_refilled_batch_leaves_no_spooled_shard_behind(src, tmp_path):
    """20 shards of 2 samples (more than a worker holds open); the order's last two cut before their first
    image: that whole batch is refilled from the start of the order under skip, whose shards the order had
    passed and deleted (and the workers closed), so the workers fetch them again; they are deleted again once
    read. After the epoch the spool holds only shards an order wants, and once the loader is closed only its
    log. (A seed is taken whose next epoch does not begin with those shards, which its readahead would keep.)"""
    root = tmp_path / "www"
    root.mkdir()
    for s, data in enumerate(tar_shards(src, 2)):
        (root / f"shard-{s:03d}.tar").write_bytes(data)
    server = HttpServer(root)
    try:
        source = remote_tar_source(f"{server.url}/shard-{{000..019}}.tar", samples_per_shard=2,
                                   spool_dir=str(tmp_path / "spool"), readahead=2, window=1)
        kw = {k: v for k, v in KW.items() if k != "seed"}
        for seed in range(200):
            loader = ImageLoader(source, num_workers=2, on_error="skip", seed=seed, **kw)
            order, following = loader.sampler.remaining(), loader.sampler.epoch_indices(1)
            cut, refill = {i // 2 for i in order[-4:]}, {i // 2 for i in order[:4]}  # sample i in shard i // 2
            if not refill & {i // 2 for i in following[:24]}:
                break
            loader.close()
        with loader:
            assert len(cut) == 2 and not cut & refill
            for s in cut:
                shard = root / f"shard-{s:03d}.tar"
                shard.write_bytes(shard.read_bytes()[: int(tar_source(shard)._offset[0]) + 100])
            batches = _epoch(loader)
            skipped = {p for p, _ in loader.stats["skipped"]}
            spool = source.spool
            # every spooled shard is one an order still wants (the next epoch's readahead has begun)
            kept = [u for u in source.urls if os.path.exists(spool.path_of(u)) and u not in spool._users]
            made = spool.made()
        assert len(batches) == 10 and batches[-1][0] == order[:4]  # refilled from the order's first entries
        assert len(skipped) == 4 and all(any(f"shard-{s:03d}.tar" in p for s in cut) for p in skipped)
        assert [made[f"{server.url}/shard-{s:03d}.tar"] for s in sorted(refill)] == [2, 2]  # again for the refill
        assert kept == []  # and deleted again
        # beside the log only the spool's session file, held while the source lives
        assert sorted(n for n in os.listdir(tmp_path / "spool") if not n.startswith(".session-")) == ["made.log"]
    finally:
        server.stop()


def test_storage_options_reach_the_users_endpoint_or_are_refused(s3, src, synth_root):
    """Given to ImageLoader with a URL they reach the local S3 server; beside a source object made beforehand,
    or a local path, they would be dropped, so they are refused, saying where they go."""
    with ImageLoader("s3://data/train/", storage_options=s3.storage_options, train=False, num_workers=1,
                     **{k: v for k, v in KW.items() if k != "seed"}) as loader:
        assert sorted(i for _ in loader for i in loader.batch_indices) == list(range(40))
    made = remote_tar_source("s3://data/train/", storage_options=s3.storage_options)
    with pytest.raises(ValueError, match=r"give storage_options to the function that made it \(remote_tar_source"):
        ImageLoader(made, storage_options=s3.storage_options, **KW)
    with pytest.raises(ValueError, match="is a local path"):
        ImageLoader(synth_root, storage_options={"anon": True}, **KW)


def test_a_manifest_that_is_there_but_cannot_be_read_raises_naming_its_url(http, caplog):
    """A folder URL whose manifest.json answers 500 on every try: an error naming that URL, after a warning per
    retry, never a dataset counted as if it had none; the same folder with the manifest merely absent opens."""
    pytest.importorskip("aiohttp")
    (http.root / "manifest.json").write_text("{}")
    http.fail("/manifest.json", 100, 500)
    with caplog.at_level("WARNING", logger="gpufeed"):
        with pytest.raises(OSError, match=re.escape(http.url) + r"/manifest.json: cannot read the shard manifest after "
                                          r"3 attempts \(.*500"):
            create_source(http.url + "/")
    assert sum(f"{http.url}/manifest.json: cannot read the shard manifest" in r.getMessage()
               for r in caplog.records) == 2
    (http.root / "manifest.json").unlink()
    http.fail("/manifest.json", 0)
    assert len(create_source(http.url + "/")) == 40


def test_a_urls_retry_is_said_once_then_again_after_ten_minutes(http, caplog):
    """The first retry of a URL is one warning for the whole session (its workers' retries at DEBUG), until 10
    minutes have passed since that warning: an outage later in a long run is said again."""
    import glob

    from gpufeed.sources.spool import Spool

    spool = Spool(None, None, RetryPolicy(attempts=2, backoff=0.01))
    url = f"{http.url}/shard-003.tar"

    def said() -> int:
        caplog.clear()
        http.fail("/shard-003.tar", 1)
        with caplog.at_level("DEBUG", logger="gpufeed"):
            spool.local(url)
        spool.drop(url)
        retries = [r for r in caplog.records if "attempt 2 of 2" in r.getMessage()]
        assert len(retries) == 1 and "shard-003.tar" in retries[0].getMessage()
        return sum(r.levelname == "WARNING" for r in retries)

    assert said() == 1
    assert said() == 0  # the same outage, or a worker's retry of it: at DEBUG
    markers = glob.glob(os.path.join(spool.root, ".retried-*", "*"))
    assert markers
    for marker in markers:  # that warning 11 minutes old
        os.utime(marker, (time.time() - 660, time.time() - 660))
    assert said() == 1
    assert said() == 0


def test_an_item_whose_lock_is_held_for_ever_is_made_here_once_a_fetch_could_have_ended(tmp_path):
    """A process holding an item's lock and never letting go (a hung fetch, a child forked during one): another
    waits as long as one fetch may take (its retries' deadline, one attempt's and a spare), then makes the item
    itself, whole."""
    import fcntl

    from gpufeed.sources.fetch import FetchLimits
    from gpufeed.sources.spool import FETCH_WAIT_SPARE, Spool

    spool = Spool(str(tmp_path / "spool"), None, RetryPolicy(attempts=1, deadline=0.5), limits=FetchLimits(deadline=0.5))
    url = "https://example.invalid/shard-000.tar"
    path = spool.path_of(url)
    held = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # another open file: this process conflicts with it as another would
    got: list = []
    try:
        start = time.monotonic()
        maker = threading.Thread(target=lambda: got.append(spool.local(url, make=lambda part: open(part, "wb").write(
            b"whole item"))), daemon=True)
        maker.start()
        maker.join(30)
        waited = time.monotonic() - start
        assert not maker.is_alive(), f"still waiting on the lock after {waited:.1f} s"
    finally:
        os.close(held)
    with open(got[0], "rb") as f:
        assert f.read() == b"whole item"
    assert 1.0 + FETCH_WAIT_SPARE - 0.5 <= waited < 1.0 + FETCH_WAIT_SPARE + 5
