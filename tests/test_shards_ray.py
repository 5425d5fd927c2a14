"""`gpufeed shards --engine ray`: a real local Ray cluster started here (two CPUs) makes the same shards, byte
for byte, as the local engine: tar and Parquet, sized in samples or in bytes (the probe run on Ray too), to a
folder or to S3 (moto's server), and stops on a broken input under on_error="raise"."""

from __future__ import annotations

import pytest

from gpufeed.shards import BrokenInput, ShardOptions, ShardSize, write_shards

from .servers import S3Server
from .test_shards import MAX_SIDE, _check_delivered, _odd_folder

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pytestmark = pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False)  # the engine finds this one (ray.is_initialized)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    return root, _odd_folder(root)


def _same_files(a, b) -> list[str]:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    return names


@pytest.mark.parametrize("fmt, size", [("tar", "7"), ("parquet", "12KB")])
def test_ray_makes_the_same_shards_as_the_local_engine(cluster, odd, tmp_path, fmt, size):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    root, inputs = odd
    options = dict(format=fmt, max_side=MAX_SIDE, shard_size=ShardSize.parse(size))
    write_shards(root, tmp_path / "local", ShardOptions(**options, workers=2))
    write_shards(root, tmp_path / "ray", ShardOptions(**options, engine="ray", workers=2))
    assert len(_same_files(tmp_path / "local", tmp_path / "ray")) > 3
    _check_delivered(tmp_path / "ray", inputs)


def test_ray_stops_at_a_broken_input_under_raise(cluster, odd, tmp_path):
    root, _ = odd
    with pytest.raises(BrokenInput, match="c_broken"):
        write_shards(root, tmp_path / "out", ShardOptions(on_error="raise", engine="ray", workers=1))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_ray_writes_to_s3_what_the_local_engine_writes_to_a_folder(cluster, synth_root, tmp_path):
    server = S3Server()
    try:
        server.bucket("out")
        options = dict(max_side=48, shard_size=ShardSize(12))
        local = write_shards(synth_root, tmp_path / "local", ShardOptions(**options, workers=1))
        remote = write_shards(synth_root, "s3://out/shards", ShardOptions(**options, engine="ray", workers=2),
                              storage_options=server.storage_options)
        assert remote == local
        listed = server.client.list_objects_v2(Bucket="out", Prefix="shards/")["Contents"]
        assert sorted(o["Key"] for o in listed) == sorted(f"shards/{p.name}" for p in (tmp_path / "local").iterdir())
        for o in listed:
            body = server.client.get_object(Bucket="out", Key=o["Key"])["Body"].read()
            assert body == (tmp_path / "local" / o["Key"].split("/")[1]).read_bytes(), o["Key"]
    finally:
        server.stop()
