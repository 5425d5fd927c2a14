"""`gpufeed shards` to an S3 URL (moto's server, real s3fs): the same objects as a local conversion, the loader
counting the shards from the manifest without fetching one, a finished conversion left alone, and a killed
one resumed to the same objects."""

from __future__ import annotations

import json

import pytest

from gpufeed import ImageLoader
from gpufeed.cli import main
from gpufeed.shards import ShardOptions, ShardSize, write_shards
from gpufeed.sources import create_source

from .servers import S3Server
from .test_shards import encode, kill_part_way, smooth

OPTIONS = dict(max_side=48, shard_size=ShardSize(12))
KW = dict(batch_size=4, image_size=16, device="cpu", num_workers=2, train=False, drop_last=False)


@pytest.fixture()
def s3(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))  # no shard index cache to count from
    server = S3Server()
    server.bucket("out")
    yield server
    server.stop()


def _objects(server, prefix: str) -> dict[str, bytes]:
    listed = server.client.list_objects_v2(Bucket="out", Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: server.client.get_object(Bucket="out", Key=o["Key"])["Body"].read() for o in listed}


def _puts(server, suffix: str) -> int:
    return sum(1 for m, p, _ in server.requests if m == "PUT" and p.endswith(suffix))


def test_s3_destination_holds_the_local_conversion_and_the_loader_counts_from_its_manifest(s3, synth_root, tmp_path):
    local = write_shards(synth_root, tmp_path / "local", ShardOptions(**OPTIONS, workers=1))
    remote = write_shards(synth_root, "s3://out/train", ShardOptions(**OPTIONS, workers=2),
                          storage_options=s3.storage_options)
    assert remote == local
    objects = _objects(s3, "train/")
    assert objects == {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    fetched = len(s3.gets("test", ".tar"))
    src = create_source("s3://out/train", storage_options=s3.storage_options)
    assert len(s3.gets("test", ".tar")) == fetched  # counted from the manifest: no shard fetched to count it
    assert src.groups == tuple(s["samples"] for s in local["shards"]) and src.shard_options["max_side"] == 48
    expected = create_source(tmp_path / "local")
    with ImageLoader("s3://out/train", storage_options=s3.storage_options, **KW) as loader:
        assert loader.stats["shards"]["manifest"] == "s3://out/train/manifest.json"
        seen = []
        for _, labels in loader:
            assert labels.tolist() == [expected.label(i) for i in loader.batch_indices]
            seen += loader.batch_indices
    assert sorted(seen) == list(range(40))
    puts = _puts(s3, ".tar")
    write_shards(synth_root, "s3://out/train", ShardOptions(**OPTIONS, workers=1), storage_options=s3.storage_options)
    assert _puts(s3, ".tar") == puts  # finished: nothing uploaded again


def test_a_killed_conversion_to_s3_resumes_to_the_same_objects(s3, tmp_path):
    root = tmp_path / "src"
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(100):
            (root / f"c{c}" / f"{i:03d}.jpg").write_bytes(encode(smooth(400, 300, 1000 * c + i)))
    args = ["--max-side", "40", "--shard-size", "8", "--workers", "1", "--storage-options",
            json.dumps(s3.storage_options)]
    assert main(["shards", str(root), str(tmp_path / "whole"), *args[:-2]]) == 0
    shards_up = lambda: sum(1 for k in _objects(s3, "part/") if k.startswith("shard-"))
    kill_part_way(["shards", str(root), "s3://out/part", *args], shards_up)
    finished = {k: v for k, v in _objects(s3, "part/").items() if k.startswith("shard-")}
    assert 3 <= len(finished) < 25 and "manifest.json" not in _objects(s3, "part/")
    with pytest.raises(ValueError, match=r"'s3://out/part' holds an unfinished `gpufeed shards` conversion"):
        ImageLoader("s3://out/part", storage_options=s3.storage_options, **KW)
    puts = _puts(s3, ".tar")
    assert main(["shards", str(root), "s3://out/part", *args]) == 0
    assert _objects(s3, "part/") == {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
    assert _puts(s3, ".tar") - puts == 25 - len(finished)  # the finished shards were not uploaded again
