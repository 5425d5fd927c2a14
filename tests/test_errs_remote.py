"""Remote errors that point the right way: missing credentials and refused ones are not retried and name
the URL (never a credential), on moto's S3 server through s3fs; gpufeed's retries are the only ones on the
calls it retries, counted at an HTTP server answering 503 as an S3 endpoint."""

from __future__ import annotations

import time

import pytest

from gpufeed.sources import RetryPolicy, create_source, remote_tar_source
from gpufeed.synth import tar_shards

from .servers import HttpServer, S3Server, own_index_cache, src  # noqa: F401 (fixtures)

SECRET = "gpufeed-test-secret-value"


@pytest.fixture()
def s3(src):
    """Two shards of 5 samples at s3://data/train/shard-000.tar and -001."""
    server = S3Server()
    server.bucket("data")
    for s, data in enumerate(tar_shards(src, 5, 10)):
        server.put("data", f"train/shard-{s:03d}.tar", data)
    yield server
    server.stop()


@pytest.fixture()
def no_credentials(tmp_path, monkeypatch):
    """An environment where botocore finds no credentials: no AWS variables, no config files, and no
    instance metadata service asked (its address is not on this machine)."""
    import os

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("url, named", [("s3://data/train/shard-{000..001}.tar", "s3://data/train/shard-00"),
                                        ("s3://data/train/", "s3://data/train/")])
def test_no_credentials_fails_at_once_naming_the_url_and_where_credentials_come_from(s3, no_credentials, url, named):
    options = {"client_kwargs": {"endpoint_url": s3.endpoint, "region_name": "us-east-1"}}
    start = time.monotonic()
    with pytest.raises(PermissionError) as raised:
        create_source(url, storage_options=options)  # the default RetryPolicy: 6 attempts over about 15 s
    elapsed = time.monotonic() - start
    message = str(raised.value)
    assert elapsed < 8, f"{elapsed:.1f} s: retried ({message})"
    assert named in message and "NoCredentialsError" in message and "not retried" in message
    assert "AWS_ACCESS_KEY_ID" in message and "anon" in message  # the way out
    assert "\n" not in message and "attempts" not in message
    assert s3.gets(None) == []  # nothing was sent unsigned


@pytest.fixture()
def refusing(s3, monkeypatch):
    """moto checks every request's access key from now on: any key this test gives is unknown to it (403
    InvalidAccessKeyId); the setting is put back after the test."""
    from moto import settings
    from moto.core.responses import ActionAuthenticatorMixin

    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    return s3


def test_a_refused_key_is_asked_once_and_named_by_url_never_by_its_secret(refusing):
    options = {"key": "unknown-key", "secret": SECRET,
               "client_kwargs": {"endpoint_url": refusing.endpoint, "region_name": "us-east-1"}}
    # through fsspec (moto answers a presigned URL with a 500 once it checks keys)
    source = remote_tar_source("s3://data/train/shard-{000..001}.tar", samples_per_shard=5, storage_options=options,
                               direct_get=False, retry=RetryPolicy(attempts=6, backoff=0.5))
    with pytest.raises(OSError) as raised:
        source.read(7)
    message = str(raised.value)
    assert message.startswith("s3://data/train/shard-001.tar: cannot fetch the file: no credentials, or access "
                              "refused"), message
    assert "not retried" in message and SECRET not in message and "\n" not in message
    # one request in all: not gpufeed's six attempts, nor s3fs's or botocore's own
    assert refusing.gets("unknown-key", "/data/train/shard-001.tar") == ["/data/train/shard-001.tar"]

    with pytest.raises(PermissionError) as raised:
        create_source("s3://data/train/", storage_options=options)
    message = str(raised.value)
    assert message.startswith("s3://data/train/manifest.json: cannot read the shard manifest: no credentials, or "
                              "access refused"), message
    assert SECRET not in message


def test_gpufeeds_attempts_are_the_only_ones_through_s3fs(tmp_path, src):
    """An HTTP server answering 503 stands as the S3 endpoint: each of the policy's attempts is one GET
    (botocore alone would make five of each, s3fs's loop more)."""
    root = tmp_path / "www"
    (root / "data" / "train").mkdir(parents=True)
    (root / "data" / "train" / "shard-000.tar").write_bytes(tar_shards(src, 5, 5)[0])
    server = HttpServer(root)
    try:
        server.fail("/data/train/shard-000.tar", 1000, 503)
        options = {"key": "test", "secret": SECRET,
                   "client_kwargs": {"endpoint_url": server.url, "region_name": "us-east-1"}}
        source = remote_tar_source("s3://data/train/shard-000.tar", samples_per_shard=5, storage_options=options,
                                   direct_get=False, retry=RetryPolicy(attempts=3, backoff=0.05, max_wait=0.1))
        with pytest.raises(OSError, match=r"^s3://data/train/shard-000\.tar: cannot fetch the file after 3 attempts"):
            source.read(0)
        assert server.requests == ["/data/train/shard-000.tar"] * 3
        # the user's own retry setting stays theirs
        mine = dict(options, config_kwargs={"retries": {"total_max_attempts": 2}})
        source = remote_tar_source("s3://data/train/shard-000.tar", samples_per_shard=5, storage_options=mine,
                                   direct_get=False, retry=RetryPolicy(attempts=3, backoff=0.05, max_wait=0.1),
                                   spool_dir=str(tmp_path / "spool"))
        with pytest.raises(OSError):
            source.read(0)
        assert server.requests == ["/data/train/shard-000.tar"] * (3 + 3 * 2)
    finally:
        server.stop()


_WITHOUT_FSSPEC = """
import sys
sys.modules["fsspec"] = sys.modules["aiohttp"] = None  # neither installed: importing them fails
from gpufeed.sources import create_source, folder_source
source = create_source(sys.argv[1])
expected = folder_source(sys.argv[2])
assert len(source) == 10, len(source)
assert [source.read(i) for i in range(10)] == [expected.read(i) for i in range(10)]
assert [source.label(i) for i in range(10)] == [expected.label(i) for i in range(10)]
assert "fsspec" not in sys.modules or sys.modules["fsspec"] is None
from gpufeed.sources.urls import scheme_status
assert scheme_status("https").startswith("tar shards only, by a plain GET (pip install 'gpufeed[http]'"), scheme_status("https")
print("read", len(source))
"""


def test_http_shards_are_read_without_fsspec_or_aiohttp(tmp_path, src, synth_root):
    """An https:// pattern needs neither: each shard is one plain GET, and no fsspec filesystem is made."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = tmp_path / "www"
    root.mkdir()
    for s, data in enumerate(tar_shards(src, 5, 10)):
        (root / f"shard-{s:03d}.tar").write_bytes(data)
    server = HttpServer(root)
    try:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent / "src"))
        run = subprocess.run([sys.executable, "-c", _WITHOUT_FSSPEC, f"{server.url}/shard-{{000..001}}.tar",
                              str(synth_root)], capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "read 10"
        assert sorted(set(server.requests)) == ["/shard-000.tar", "/shard-001.tar"]
    finally:
        server.stop()


def test_a_local_file_refused_is_not_taken_for_missing_credentials(tmp_path):
    """A PermissionError naming a local file (the spool's own) is said as it is, not as the store's
    credentials; nor is it retried."""
    from gpufeed.sources.retry import with_retries

    calls = []

    def write():
        calls.append(1)
        raise PermissionError(13, "Permission denied", str(tmp_path / "part"))  # as os.open raises it

    with pytest.raises(OSError) as raised:
        with_retries(write, "s3://data/train/shard-000.tar", RetryPolicy(attempts=3, backoff=0.05), "fetch the file")
    message = str(raised.value)
    assert message.startswith("s3://data/train/shard-000.tar: cannot fetch the file (PermissionError: [Errno 13]")
    assert str(tmp_path / "part") in message and "credentials" not in message
    assert calls == [1]


def test_gpufeed_shards_without_credentials_says_it_in_one_line(s3, no_credentials, tmp_path, capsys):
    import json

    from gpufeed.cli import main

    options = json.dumps({"client_kwargs": {"endpoint_url": s3.endpoint, "region_name": "us-east-1"}})
    assert main(["shards", "s3://data/train/", str(tmp_path / "out"), "--storage-options", options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpufeed shards: error: ") and err.count("\n") == 1, err
    assert "s3://data/train/" in err and "AWS_ACCESS_KEY_ID" in err and "Traceback" not in err
