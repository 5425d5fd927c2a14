"""Hostile spools, caches and servers through the public API, against real servers started here (the
standard library's HTTP server, moto's S3): planted pickles, links and stale copies, a shared spool, a
spool left by a killed process, presigned tokens, a server that drips, one whose body never ends, one whose
certificate fails, credentials on the command line. Every hostile file is made here."""

from __future__ import annotations

import datetime
import gc
import http.server as http_server
import ipaddress
import json
import os
import pickle
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse

import pytest

from gpufeed import ImageLoader, WorkerError
from gpufeed.sources import FetchLimits, RetryPolicy, remote_tar_source
from gpufeed.sources.fetch import http_get
from gpufeed.sources.retry import transient
from gpufeed.synth import tar_shards

from .servers import FAST, HttpServer, S3Server, own_index_cache, shards_over_http, src  # noqa: F401 (fixtures)

KW = dict(batch_size=4, image_size=16, device="cpu", seed=3)


@pytest.fixture()
def http(tmp_path, src):
    """8 shards of 5 samples served over HTTP: {url}/shard-000.tar ... shard-007.tar (sample i in shard i // 5)."""
    server = shards_over_http(tmp_path / "www", src)
    yield server
    server.stop()


class Payload:
    """Unpickled, it would touch ``marker``: what a planted pickle in a spool could run."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _delivered(loader, src):
    ids = []
    for _, labels in loader:
        assert labels.tolist() == [src.label(i) for i in loader.batch_indices]
        ids += loader.batch_indices
    return ids


# ---- the spool and the index cache -----------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o1777, 0o770])
def test_a_shared_spool_dir_is_refused_saying_why_and_nothing_in_it_is_read(tmp_path, http, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    marker = tmp_path / "ran"
    (shared / "planted.members").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(PermissionError, match=rf"spool_dir '.*shared' has mode {mode:04o}: group- or world-writable"):
        remote_tar_source(http.pattern, samples_per_shard=5, spool_dir=str(shared))
    assert not marker.exists() and os.listdir(shared) == ["planted.members"] and http.requests == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_spool_dir_owned_by_another_user_is_refused(tmp_path, http):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, -1)
    with pytest.raises(PermissionError, match=r"spool_dir '.*theirs' is owned by uid 12345, not by this user"):
        remote_tar_source(http.pattern, samples_per_shard=5, spool_dir=str(theirs))


def test_a_world_writable_temporary_folder_for_default_spools_is_refused(tmp_path, http, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = tmp_path / f"gpufeed-{os.getuid()}"
    base.mkdir()
    os.chmod(base, 0o777)  # made by someone else before this user's first run
    with pytest.raises(PermissionError, match=r"gpufeed's temporary folder .* mode 0777"):
        remote_tar_source(http.pattern, samples_per_shard=5)


def test_planted_pickles_and_links_in_the_spool_and_cache_are_never_run_or_followed(tmp_path, http, src):
    """In the user's own spool_dir: a pickle where a shard's member index goes, a link where the log goes
    and one where a failure marker goes; pickles in place of every index cache entry. All 40 samples come
    with their own labels, the pickles never run, the victim file is never written or read as a marker."""
    spool_dir, marker, victim = tmp_path / "spool", tmp_path / "ran", tmp_path / "victim.txt"
    victim.write_text("keep me")
    assert len(remote_tar_source(http.pattern, spool_dir=str(spool_dir))) == 40  # indexed: counts in the cache
    entries = sorted((tmp_path / "cache" / "shard-index").iterdir())
    assert len(entries) == 8
    for entry in entries:
        entry.write_bytes(pickle.dumps(Payload(marker)))
    source = remote_tar_source(http.pattern, spool_dir=str(spool_dir))  # the planted entries: indexed again
    assert len(source) == 40
    copy = source.spool.local(source.urls[0])
    with open(copy + ".members", "wb") as f:
        f.write(pickle.dumps(Payload(marker)))
    os.unlink(spool_dir / "made.log")
    os.symlink(victim, spool_dir / "made.log")
    os.symlink(victim, source.spool.path_of(source.urls[1]) + ".failed")  # fresh: it would fail shard-001
    with ImageLoader(source, num_workers=2, **KW) as loader:
        assert sorted(_delivered(loader, src)) == list(range(40))
    assert not marker.exists() and victim.read_text() == "keep me"
    assert not os.path.islink(spool_dir / "made.log")


def test_a_stale_copy_is_served_only_while_it_matches_the_remote_object(tmp_path, http, src):
    """A copy left in a spool_dir by a run now over is used again only while the remote shard has its size
    and date; one changed since, and one planted without a record, are fetched again."""
    spool_dir = str(tmp_path / "spool")
    first = remote_tar_source(http.pattern, samples_per_shard=5, spool_dir=spool_dir)
    assert first.read(0) == src.read(0) and first.read(10) == src.read(10)  # copies of shard-000 and -002
    kept = first.spool.path_of(first.urls[0])
    del first
    gc.collect()  # that run is over: its session ends, its copies stay
    gets = len(http.requests)
    same = remote_tar_source(http.pattern, samples_per_shard=5, spool_dir=spool_dir)
    assert same.read(11) == src.read(11) and len(http.requests) == gets  # unchanged remotely: no GET
    del same
    gc.collect()
    replacement = (http.root / "shard-001.tar").read_bytes()
    assert len(replacement) != os.path.getsize(kept)
    (http.root / "shard-000.tar").write_bytes(replacement)  # other samples under the same name
    again = remote_tar_source(http.pattern, samples_per_shard=5, spool_dir=spool_dir)
    assert [again.read(k) for k in range(5)] == [src.read(5 + k) for k in range(5)]
    assert [again.label(k) for k in range(5)] == [src.label(5 + k) for k in range(5)]
    planted = again.spool.path_of(again.urls[3])
    with open(planted, "wb") as f:
        f.write((http.root / "shard-004.tar").read_bytes())  # no record of its making
    assert again.read(15) == src.read(15) and again.label(15) == src.label(15)


KILLED = """
import sys, time
from gpufeed.sources import remote_tar_source
source = remote_tar_source(sys.argv[1], samples_per_shard=5)
source.read(0)
print(source.spool.root, flush=True)
time.sleep(120)
"""


def _spooling(code: str, tmp_path, pattern: str) -> tuple[subprocess.Popen, object]:
    """``code`` run on ``pattern`` in a process of its own whose temporary folder is ``tmp_path/tmp``: (the
    process, reading its stdout; that folder)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "killed.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script), pattern], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)})
    return proc, tmp


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_default_spool_left_by_a_killed_process_is_removed_at_the_next_start(tmp_path, http, monkeypatch, sig):
    proc, tmp = _spooling(KILLED, tmp_path, http.pattern)
    try:
        root = proc.stdout.readline().strip()
        assert root.startswith(str(tmp)) and any(n.endswith(".tar") for n in os.listdir(root))
        proc.send_signal(sig)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert os.path.isdir(root)  # no exit handler ran
    base = os.path.dirname(root)
    assert os.stat(base).st_mode & 0o777 == 0o700 and os.stat(root).st_mode & 0o777 == 0o700
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    fresh = remote_tar_source(http.pattern, samples_per_shard=5)
    assert not os.path.exists(root) and os.path.dirname(fresh.spool.root) == base


KILLED_WITH_A_CHILD = """
import os, sys, time
from gpufeed.sources import remote_tar_source
source = remote_tar_source(sys.argv[1], samples_per_shard=5)
source.read(0)
child = os.fork()
if child == 0:  # the user's own child: it inherits every descriptor, the session's lock among them
    time.sleep(120)
    os._exit(0)
print(source.spool.root, child, flush=True)
time.sleep(120)
"""


def test_a_killed_process_s_spool_is_removed_though_a_child_it_forked_lives_on(tmp_path, http, monkeypatch):
    """The child holds the session's lock (an inherited descriptor); the owner named in the session file is
    gone, so the next spool made removes the dead one's."""
    proc, tmp = _spooling(KILLED_WITH_A_CHILD, tmp_path, http.pattern)
    child = None
    try:
        root, child = proc.stdout.readline().split()
        child = int(child)
        proc.kill()
        proc.wait(10)
        os.kill(child, 0)  # the child lives on
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        fresh = remote_tar_source(http.pattern, samples_per_shard=5)
        assert not os.path.exists(root) and os.path.dirname(fresh.spool.root) == os.path.dirname(root)
        fresh.read(0)  # and a live spool is left alone by its own sweep
        remote_tar_source(http.pattern, samples_per_shard=5)
        assert os.path.isdir(fresh.spool.root)
    finally:
        if proc.poll() is None:
            proc.kill()
        if child:
            os.kill(child, signal.SIGKILL)


def test_bad_labels_in_a_remote_shard_fail_alone_naming_url_and_member(tmp_path, src):
    from .test_security import TAR_LABELS, _tar_with_labels

    root = tmp_path / "www"
    root.mkdir()
    _tar_with_labels(root / "s.tar", TAR_LABELS)
    server = HttpServer(root)
    try:
        source = remote_tar_source([f"{server.url}/s.tar"], samples_per_shard=8)
        assert [source.label(k) for k in (0, 1, 4, 5, 7)] == [0, 1, 10**12, 2, 1]
        with pytest.raises(ValueError, match=r"/s\.tar:000002\.cls: label must be >= 0, got -3"):
            source.label(2)  # not a missing .cls: the one there holds no label
        with pytest.raises(ValueError, match=r"/s\.tar:000006\.cls: label 9{30} does not fit in int64"):
            source.label(6)
        with ImageLoader(source, num_classes=3, on_error="skip", num_workers=2, drop_last=False, **KW) as loader:
            labels = [y for _, ys in loader for y in ys.tolist()]
            skipped = sorted(p.rsplit(":", 1)[-1] for p, _ in loader.stats["skipped"])
        assert skipped == [f"{k:06d}.jpg" for k in (2, 3, 4, 6)] and len(labels) == 8 and set(labels) <= {0, 1, 2}
    finally:
        server.stop()


def test_links_devices_and_fifos_in_a_remote_shard_are_left_out_and_counted_as_a_local_tars_are(tmp_path, caplog):
    """A remote shard's symlink, hard link, device and FIFO members named like images are never read, and the
    loader's stats count and list each as left out (not as skipped samples), once however many epochs read
    the shard, with one warning naming the URL and the first."""
    from tests.corpus import tar_with_links

    root = tmp_path / "www"
    root.mkdir()
    tar_with_links(root / "s.tar")
    server = HttpServer(root)
    try:
        source = remote_tar_source([f"{server.url}/s.tar"], samples_per_shard=1, spool_dir=str(tmp_path / "spool"))
        with caplog.at_level("WARNING", logger="gpufeed"):
            with ImageLoader(source, batch_size=1, image_size=16, device="cpu", num_workers=1, train=False) as loader:
                for _ in range(2):
                    assert [y.tolist() for _, y in loader] == [[3]]
                stats = loader.stats
    finally:
        server.stop()
    assert stats["left_out_count"] == 4 and stats["skipped_count"] == 0 and stats["skipped"] == []
    assert [p for p, _ in stats["left_out"]] == [f"{server.url}/s.tar:{n}" for n in ("sym.jpg", "hard.jpg", "dev.jpg",
                                                                                       "fifo.jpg")]
    assert all("links, devices and FIFOs are never read" in why for _, why in stats["left_out"])
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 1 and f"4 members of {server.url}/s.tar with image names are left out" in said[0], said
    assert "'sym.jpg'" in said[0] and "loader.stats['left_out']" in said[0]


# ---- secrets -------------------------------------------------------------------------------------


def _all_text(*folders) -> str:
    out = []
    for folder in folders:
        for dirpath, _, files in os.walk(folder):
            for name in files:
                out.append(name)
                with open(os.path.join(dirpath, name), "rb") as f:
                    out.append(f.read().decode("utf-8", "replace"))
    return "\n".join(out)


def test_a_presigned_token_never_reaches_errors_logs_or_cache_files(tmp_path, src):
    server = S3Server()
    try:
        server.bucket("data")
        for s, data in enumerate(tar_shards(src, 5)):
            server.put("data", f"train/shard-{s:03d}.tar", data)
        sign = lambda key: server.client.generate_presigned_url(  # noqa: E731
            "get_object", Params={"Bucket": "data", "Key": key}, ExpiresIn=600)
        urls = [sign(f"train/shard-{s:03d}.tar") for s in range(8)] + [sign("train/shard-404.tar")]
        tokens = [v for u in urls for k, v in urllib.parse.parse_qsl(urllib.parse.urlsplit(u).query)
                  if "Signature" in k or "Credential" in k]
        assert len(tokens) >= 9
        spool_dir = tmp_path / "spool"
        assert len(remote_tar_source(urls[:8], spool_dir=str(spool_dir))) == 40  # fetched, indexed, cached
        texts = []
        with pytest.raises(FileNotFoundError, match=r"shard-404\.tar\?.*Signature=\[redacted\]") as info:
            remote_tar_source(urls, spool_dir=str(spool_dir))
        texts.append(str(info.value))
        source = remote_tar_source(urls, samples_per_shard=5, spool_dir=str(spool_dir))
        with ImageLoader(source, num_workers=2, on_error="skip", drop_last=False, **KW) as loader:
            assert set(_delivered(loader, src)) == set(range(40))
            skipped = loader.stats["skipped"]
        assert len(skipped) == 5 and all("shard-404.tar" in p for p, _ in skipped)
        texts += [f"{p} {r}" for p, r in skipped] + [source.path(i) for i in range(45)]
        with ImageLoader(source, num_workers=1, **KW) as loader:
            with pytest.raises(WorkerError, match=r"shard-404\.tar") as info:
                list(loader)
        texts.append(str(info.value))
        texts.append(_all_text(spool_dir, tmp_path / "cache"))
        text = "\n".join(texts)
        assert "shard-404.tar" in text and "made.log" in text
        for token in tokens:
            assert token not in text and urllib.parse.quote(token, safe="") not in text
    finally:
        server.stop()


def test_storage_option_values_never_reach_the_bench_output_or_its_errors(tmp_path, capsys, src):
    from gpufeed.cli import main

    server = S3Server()
    try:
        server.bucket("data")
        for s, data in enumerate(tar_shards(src, 5)):
            server.put("data", f"train/shard-{s:03d}.tar", data)
        secret = "hunter2-secret-access-key"
        options = dict(server.storage_options, key="AKIAEXAMPLEKEY0000", secret=secret)
        rc = main(["bench", "--data", "s3://data/train/", "--storage-options", json.dumps(options), "--batch-size", "8",
                   "--workers", "1", "--epochs", "2", "--device", "cpu", "--json", str(tmp_path / "r.json")])
        assert rc == 0
        result = (tmp_path / "r.json").read_text()
        assert json.loads(result)["config"]["storage_options"]["secret"] == "<redacted>"
        bad = json.dumps(options)[:-1] + ","  # not JSON any more
        assert main(["bench", "--data", "s3://data/train/", "--storage-options", bad]) == 2
        assert main(["bench", "--data", "s3://data/train/", "--storage-options", json.dumps([secret])]) == 2
        out = capsys.readouterr()
        assert "is not JSON (" in out.err and "got a JSON list" in out.err
        for text in (result, out.out, out.err):
            assert secret not in text and "AKIAEXAMPLEKEY0000" not in text
    finally:
        server.stop()


# ---- servers that never finish, and errors another attempt cannot fix ----------------------------------


class _Hostile(http_server.BaseHTTPRequestHandler):
    """/drip: a byte every 0.1 s of a declared megabyte; /slow: 2,000 bytes every 0.1 s of 40,000 (20 KB/s);
    /endless: a body without length that never ends; /huge: a Content-Length of a terabyte; /trickle: a body
    without length, 64 KB every 0.03 s for 12 s."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        self.send_response(200)
        if self.path.startswith("/drip"):
            self.send_header("Content-Length", str(1 << 20))
        elif self.path.startswith("/slow"):
            self.send_header("Content-Length", "40000")
        elif self.path.startswith("/huge"):
            self.send_header("Content-Length", str(1 << 40))
        self.end_headers()
        step = {"/drip": (b"x", 0.1), "/slow": (b"s" * 2000, 0.1),
                "/tric": (b"t" * 65536, 0.03)}.get(self.path[:5], (b"\0" * 65536, 0.0))
        for _ in range(20 if self.path.startswith("/slow") else 400 if self.path.startswith("/tric") else 1000):  # bounded: the client gives up long before
            try:
                self.wfile.write(step[0])
                self.wfile.flush()
            except OSError:
                return
            time.sleep(step[1])


@pytest.fixture()
def hostile():
    httpd = http_server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    httpd.requests = []
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_server_that_drips_fails_at_the_deadline_naming_the_url(hostile, tmp_path):
    httpd, url = hostile
    source = remote_tar_source([f"{url}/drip/shard.tar"], samples_per_shard=5, retry=FAST,
                               limits=FetchLimits(deadline=1.0), spool_dir=str(tmp_path / "spool"))
    began = time.monotonic()
    with pytest.raises(OSError, match=r"/drip/shard\.tar: cannot fetch the file after 2 attempts \(TimeoutError: "
                                      r".*not complete within the deadline of 1 s \(\d+ bytes came\)"):
        source.read(0)
    assert time.monotonic() - began < 8  # two attempts of the 1 s deadline, and FAST's short wait
    assert httpd.requests == ["/drip/shard.tar"] * 2  # each attempt through the plain GET, none through fsspec
    assert not [n for n in os.listdir(tmp_path / "spool") if n.endswith((".tar", ".part"))]  # nothing partial left


def test_a_stalled_transfer_fails_at_the_low_speed_rule_and_a_slow_one_finishes(hostile, tmp_path):
    """The drip (10 bytes/s) under a rule of 1,000 bytes/s over 1 s fails each attempt in about a second,
    long before its deadline; the slow server (20 KB/s for 2 s) passes the same rule and its file arrives."""
    httpd, url = hostile
    limits = FetchLimits(deadline=120.0, low_speed=1000, low_speed_time=1.0)
    source = remote_tar_source([f"{url}/drip/shard.tar"], samples_per_shard=5, retry=FAST, limits=limits,
                               spool_dir=str(tmp_path / "spool"))
    began = time.monotonic()
    with pytest.raises(OSError, match=r"/drip/shard\.tar: cannot fetch the file after 2 attempts \(TimeoutError: "
                                      r".*under 1000 bytes/s for 1 s \(\d+ bytes came\)"):
        source.read(0)
    assert time.monotonic() - began < 8
    path = tmp_path / "slow.bin"
    began = time.monotonic()
    http_get(f"{url}/slow/file", str(path), FetchLimits(low_speed=10_000, low_speed_time=0.5))
    assert path.read_bytes() == b"s" * 40000 and time.monotonic() - began > 1.5  # it was slow, and it finished
    with pytest.raises(ValueError, match="low_speed must be an integer number of bytes/s >= 0"):
        FetchLimits(low_speed=-1)


def test_transfers_through_fsspec_have_the_same_low_speed_rule_deadline_and_cap(hostile, tmp_path, caplog):
    """Through fsspec's HTTP client (aiohttp), as S3 and GCS are read when no plain GET serves: the drip fails
    each attempt at the low-speed rule in about a second, and at the deadline when the rule is off; a body that
    goes on arriving stops at the byte cap; each retry is one warning naming the URL; nothing partial is left."""
    pytest.importorskip("aiohttp")
    httpd, url = hostile
    spool = tmp_path / "spool"
    cases = [(FetchLimits(deadline=120.0, low_speed=1000, low_speed_time=1.0), "/drip/a.tar",
              r"TimeoutError: .*under 1000 bytes/s for 1 s \(\d+ bytes came\)"),
             (FetchLimits(deadline=1.0, low_speed=0), "/drip/b.tar",
              r"TimeoutError: .*not complete within the deadline of 1 s \(\d+ bytes came\)"),
             # under way for 12 s: the cap stops it while it still arrives
             (FetchLimits(max_bytes=1 << 20), "/trickle/c.tar", r"TooLarge: .*more than the cap of 1048576 bytes")]
    for limits, path, message in cases:
        source = remote_tar_source([url + path + "?X-Amz-Signature=SECRETSIG"], samples_per_shard=5, retry=FAST,
                                   limits=limits, direct_get=False, spool_dir=str(spool))
        caplog.clear()
        began = time.monotonic()
        with caplog.at_level("WARNING", logger="gpufeed"):
            with pytest.raises(OSError, match=re.escape(url + path) + r"\?X-Amz-Signature=\[redacted\]: cannot fetch "
                                              r"the file.*" + message):
                source.read(0)
        assert time.monotonic() - began < 10, path
        retries = [r.getMessage() for r in caplog.records if "attempt 2 of 2" in r.getMessage()]
        if "TooLarge" in message:  # not retried: another attempt gets the same body
            assert retries == []
        else:
            assert len(retries) == 1 and url + path + "?X-Amz-Signature=[redacted]" in retries[0], retries
        assert "SECRETSIG" not in caplog.text
        assert not [n for n in os.listdir(spool) if n.endswith((".tar", ".part", ".fsspec"))]


def test_retries_end_when_the_next_would_start_past_the_retry_deadline(tmp_path):
    """A server that answers 503 every time, under a retry deadline shorter than the waits: the fetch gives
    up after the attempts that fit, saying so, instead of going through all of them."""
    root = tmp_path / "www"
    root.mkdir()
    (root / "shard.tar").write_bytes(b"x" * 1024)
    server = HttpServer(root)
    try:
        server.fail("/shard.tar", 100)
        source = remote_tar_source([f"{server.url}/shard.tar"], samples_per_shard=1, spool_dir=str(tmp_path / "s"),
                                   retry=RetryPolicy(attempts=20, backoff=0.4, max_wait=0.4, deadline=1.0))
        began = time.monotonic()
        with pytest.raises(OSError, match=r"shard\.tar: cannot fetch the file after \d attempt\(s\) in [\d.]+ s: another "
                                          r"would start past the retry deadline of 1 s \(HTTPError: HTTP Error 503"):
            source.read(0)
        assert time.monotonic() - began < 5 and 2 <= len(server.requests) <= 4
        # a wait that alone would pass the deadline is not waited: one attempt, said at once
        del server.requests[:]
        source = remote_tar_source([f"{server.url}/shard.tar"], samples_per_shard=1, spool_dir=str(tmp_path / "t"),
                                   retry=RetryPolicy(attempts=5, backoff=30.0, max_wait=30.0, deadline=20.0))
        with pytest.raises(OSError, match=r"cannot fetch the file after 1 attempt\(s\) in [\d.]+ s: another would "
                                          r"start past the retry deadline of 20 s"):
            source.read(0)
        assert server.requests == ["/shard.tar"]
    finally:
        server.stop()
    with pytest.raises(ValueError, match="deadline must be > 0 seconds or None, got 0"):
        RetryPolicy(deadline=0)
    with pytest.raises(ValueError, match="deadline must be > 0 seconds or None, got True"):
        RetryPolicy(deadline=True)  # not 1 s


def test_a_url_retried_by_several_workers_is_said_in_one_warning(tmp_path, src, caplog):
    """Three workers (pickled copies of the source, as the loader's workers get it) each fetch a shard whose
    first GET answers 503, the copy deleted behind the order between them: each retries, and the user sees one
    warning for that URL, the other retries at DEBUG level; another URL still gets its own warning."""
    server = shards_over_http(tmp_path / "www", src)
    try:
        source = remote_tar_source(server.pattern, samples_per_shard=5, retry=FAST, spool_dir=str(tmp_path / "spool"))
        workers = [pickle.loads(pickle.dumps(source)) for _ in range(3)]
        with caplog.at_level("DEBUG", logger="gpufeed"):
            for worker in workers:
                server.fail("/shard-000.tar", 1)
                source.spool.drop(source.urls[0])  # as the readahead deletes it once the order has passed it
                assert worker.read(0) == src.read(0)
            server.fail("/shard-001.tar", 1)
            assert workers[0].read(5) == src.read(5)
        assert server.requests.count("/shard-000.tar") == 6 and server.requests.count("/shard-001.tar") == 2
        retries = [(r.levelname, r.getMessage()) for r in caplog.records if "attempt 2 of 2" in r.getMessage()]
        said = [m for level, m in retries if level == "WARNING"]
        assert len(retries) == 4 and len(said) == 2, retries
        assert "/shard-000.tar: cannot fetch the file (HTTPError: HTTP Error 503" in said[0]
        assert "/shard-001.tar" in said[1] and "further retries are logged at DEBUG level" in said[1]
    finally:
        server.stop()


@pytest.mark.parametrize("path, message", [("/endless/shard.tar", "more than the cap of 1048576 bytes"),
                                           ("/huge/shard.tar", f"{1 << 40} bytes, over the cap of 1048576 bytes")])
def test_a_body_over_the_byte_cap_fails_once_naming_the_url_and_leaves_no_file(hostile, tmp_path, path, message):
    httpd, url = hostile
    source = remote_tar_source([url + path], samples_per_shard=5, retry=RetryPolicy(attempts=4, backoff=0.05),
                               limits=FetchLimits(max_bytes=1 << 20), spool_dir=str(tmp_path / "spool"))
    with pytest.raises(OSError, match=rf"{re.escape(path)}: cannot fetch the file \(TooLarge: .*{message}"):
        source.read(0)
    assert httpd.requests == [path]  # not retried, not handed over to fsspec
    assert not [n for n in os.listdir(tmp_path / "spool") if n.endswith((".tar", ".part"))]


def _self_signed(tmp_path):
    """A certificate for 127.0.0.1 that no authority signed: (certificate file, key file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(datetime.datetime(2020, 1, 1))
            .not_valid_after(datetime.datetime(2100, 1, 1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


class _Counting(http_server.ThreadingHTTPServer):
    connections = 0

    def get_request(self):
        type(self).connections += 1
        return super().get_request()


def test_a_certificate_failure_is_not_retried(tmp_path, src):
    pytest.importorskip("cryptography")
    cert, key = _self_signed(tmp_path)
    (tmp_path / "shard-000.tar").write_bytes(next(iter(tar_shards(src, 5))))
    httpd = _Counting(("127.0.0.1", 0), lambda *a: http_server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path)))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        source = remote_tar_source([f"https://127.0.0.1:{httpd.server_address[1]}/shard-000.tar"], samples_per_shard=5,
                                   retry=RetryPolicy(attempts=5, backoff=0.05))
        with pytest.raises(OSError, match=r"shard-000\.tar: cannot fetch the file \(.*[Cc]ertificate"):
            source.read(0)
        assert 1 <= _Counting.connections <= 2  # the plain GET, then fsspec's client once; not five attempts
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_what_is_retried_and_what_is_not():
    def http_error(code):
        return urllib.error.HTTPError("https://h/x", code, "status", {}, None)

    assert transient(http_error(503)) and transient(http_error(429)) and transient(http_error(408))
    assert transient(TimeoutError()) and transient(ConnectionResetError())
    assert not transient(http_error(404)) and not transient(http_error(403))
    certificate = ssl.SSLCertVerificationError("certificate verify failed")
    assert not transient(certificate) and not transient(urllib.error.URLError(certificate))
    for programming in (TypeError("x"), AttributeError("x"), KeyError("x"), NameError("x")):
        assert not transient(programming)
    wrapped = OSError("fetch failed")
    wrapped.__cause__ = TypeError("bad argument")
    assert not transient(wrapped)


def test_pyarrow_is_pinned_past_cve_2023_47248():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    for name, deps in (("the parquet extra", project["project"]["optional-dependencies"]["parquet"]),
                       ("the test group", project["dependency-groups"]["test"])):
        assert [d for d in deps if d.startswith("pyarrow")] == ["pyarrow>=14.0.1"], name
    pa = pytest.importorskip("pyarrow")
    assert tuple(int(p) for p in re.findall(r"\d+", pa.__version__)[:3]) >= (14, 0, 1)
