"""One conversion at a time in an S3 folder (moto's server, real s3fs): a live lease refuses a second
writer, naming it; a lease of a process that ended on this machine, or one that ran out, is taken over; a
conversion whose lease is taken over stops before its next shard."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from gpufeed.shards import ShardOptions, ShardSize, lease, write_shards
from gpufeed.sources.private import process_identity

from .servers import S3Server

OPTIONS = ShardOptions(max_side=48, shard_size=ShardSize(8), workers=1)
DEST = "s3://out/lease"  # moto's objects outlive a test: each test below writes under its own prefix


@pytest.fixture()
def s3(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))
    server = S3Server()
    server.bucket("out")
    for o in server.client.list_objects_v2(Bucket="out", Prefix="lease/").get("Contents", []):
        server.client.delete_object(Bucket="out", Key=o["Key"])
    yield server
    server.stop()


def _hold(s3, **record) -> None:
    s3.client.put_object(Bucket="out", Key=f"lease/{lease.HOLDER}", Body=json.dumps(record).encode())


def _objects(s3) -> list[str]:
    return sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket="out", Prefix="lease/").get("Contents", []))


def test_a_live_lease_refuses_a_second_conversion_naming_its_holder(s3, synth_root):
    _hold(s3, host=socket.gethostname(), **process_identity(os.getpid()), source="/data/a",
          token="f" * 16, until=time.time() + 60)
    with pytest.raises(ValueError) as e:
        write_shards(synth_root, DEST, OPTIONS, storage_options=s3.storage_options)
    said = str(e.value)
    assert f"process {os.getpid()} on {socket.gethostname()} converting '/data/a'" in said
    assert "whose lease runs until" in said and "lease/.gpufeed-progress/holder.json" in said
    assert "test" not in said.replace("pytest", "")  # no credential
    assert _objects(s3) == ["lease/.gpufeed-progress/holder.json"]  # nothing written


def test_another_machine_s_live_lease_refuses_and_its_lapsed_one_is_taken_over(s3, synth_root, tmp_path):
    _hold(s3, host="elsewhere", pid=1, source="/data/a", token="e" * 16, until=time.time() + 60)
    with pytest.raises(ValueError, match="process 1 on elsewhere converting '/data/a'"):
        write_shards(synth_root, DEST, OPTIONS, storage_options=s3.storage_options)
    _hold(s3, host="elsewhere", pid=1, source="/data/a", token="e" * 16, until=time.time() - 1)
    manifest = write_shards(synth_root, DEST, OPTIONS, storage_options=s3.storage_options)
    assert manifest == write_shards(synth_root, tmp_path / "local", OPTIONS)
    assert f"lease/{lease.HOLDER}" not in _objects(s3)  # released at the end


def test_the_lease_of_a_process_that_ended_on_this_machine_is_taken_over_at_once(s3, synth_root):
    ended = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    identity = process_identity(ended.pid)
    ended.wait()
    _hold(s3, **lease.this_machine(), **identity, source="/data/a", token="d" * 16, until=time.time() + 60)
    manifest = write_shards(synth_root, DEST, OPTIONS, storage_options=s3.storage_options)
    assert manifest["samples"] == 40


def test_a_conversion_whose_lease_is_taken_over_stops_before_its_next_shard(s3, synth_root):
    """Another machine's record stands (it took the lease while this conversion was stalled past its lease):
    the next shard's writer finds it and publishes nothing more."""
    taken = []

    def take_over(done: int, total: int) -> None:
        if done >= 16 and not taken:  # part way: another machine takes the destination
            _hold(s3, host="elsewhere", pid=7, source="/data/b", token="c" * 16, until=time.time() + 60)
            taken.append(done)

    with pytest.raises(ValueError, match=r"no longer holds the destination \(taken over by process 7 on elsewhere "
                                         r"converting '/data/b'\); it stopped before writing more"):
        write_shards(synth_root, DEST, OPTIONS, storage_options=s3.storage_options, progress=take_over)
    shards = [k for k in _objects(s3) if k.endswith(".tar")]
    assert len(shards) < 5 and "lease/manifest.json" not in _objects(s3)
    held = json.loads(s3.client.get_object(Bucket="out", Key=f"lease/{lease.HOLDER}")["Body"].read())
    assert held["host"] == "elsewhere"  # the other conversion's record is left as it wrote it


def test_the_lease_is_renewed_while_the_conversion_runs(s3, synth_root, monkeypatch):
    monkeypatch.setattr(lease, "RENEW_S", 0.1)
    seen = []

    def watch(done: int, total: int) -> None:
        held = json.loads(s3.client.get_object(Bucket="out", Key=f"lease/{lease.HOLDER}")["Body"].read())
        seen.append(held["until"])
        time.sleep(0.15)

    write_shards(synth_root, DEST, OPTIONS, storage_options=s3.storage_options, progress=watch)
    assert len(set(seen)) >= 3 and seen == sorted(seen)  # pushed forward again and again


def test_a_lease_that_cannot_be_renewed_stops_the_conversion_before_it_runs_out(s3, synth_root, monkeypatch):
    """The store takes no more writes of the record (a policy change, say): the holder counts its lease on its
    own clock and stops before it could run out in the store, where another conversion would take it."""
    from gpufeed.shards.dest import Destination

    monkeypatch.setattr(lease, "LEASE_S", 0.9)
    monkeypatch.setattr(lease, "RENEW_S", 0.2)
    write_json = Destination.write_json
    taken = []

    def refused_after_take(self, name, doc):
        if name == lease.HOLDER and taken:
            raise PermissionError("AccessDenied")
        write_json(self, name, doc)
        if name == lease.HOLDER:
            taken.append(name)

    monkeypatch.setattr(Destination, "write_json", refused_after_take)
    with pytest.raises(ValueError, match=r"no longer holds the destination \(its lease could not be renewed in "
                                         r"time\); it stopped before writing more"):
        write_shards(synth_root, DEST, OPTIONS, storage_options=s3.storage_options,
                     progress=lambda done, total: time.sleep(0.3))
    assert "lease/manifest.json" not in _objects(s3)


def test_two_conversions_taking_the_lease_at_once_leave_one_holder(s3, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from gpufeed.shards.dest import Destination

    dest = Destination(DEST, s3.storage_options)
    leases = [lease.Lease(dest, {"source": f"/data/{k}"}) for k in range(2)]

    def take(k: int):
        time.sleep(0.3 * k)  # within the settling time of each other
        try:
            leases[k].take()
            return None
        except ValueError as e:
            return str(e)

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(take, range(2)))
    assert sorted(o is None for o in outcomes) == [False, True], outcomes  # exactly one holds it
    winner = outcomes.index(None)
    held = json.loads(s3.client.get_object(Bucket="out", Key=f"lease/{lease.HOLDER}")["Body"].read())
    assert held["token"] == leases[winner].token and f"converting '/data/{winner}'" in outcomes[1 - winner]
    leases[winner].release()
    assert f"lease/{lease.HOLDER}" not in _objects(s3)
