"""Many ranks: every rank yields len(loader) full batches whatever it skips, samples are delivered exactly
once across ranks, a state saved on one world size resumes on another, and DDP over gloo does not hang."""

import collections
import os
import socket
import subprocess
import sys

import pytest
import torch

from gpufeed import ImageLoader
from gpufeed.sampling import ShardedSampler
from gpufeed.sources import folder_source
from tests.helpers import textured

N = 70


def _dataset(root, broken_on=(5, 1), seed=0, batch_size=8):
    """70 textured JPEGs (so two crops of one differ) in 3 classes; ``broken_on[r]`` of those rank r of 2 gets
    in epoch 0 are broken."""
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
    for i in range(N):
        textured(40 + i % 9, 36, seed=i).save(root / f"c{i % 3}" / f"{i:02d}.jpg", quality=95)
    src = folder_source(root)
    broken = []
    for rank, k in enumerate(broken_on):
        shard = ShardedSampler(N, seed=seed, rank=rank, world_size=2).epoch_indices()
        broken += shard[1 : 1 + 2 * k : 2]  # spread over the first batches
    for i in broken:
        with open(src.path(i), "wb") as f:
            f.write(b"\xff\xd8\xff\xe0 not a jpeg")
    return src, set(broken)


def _reference(root, epoch, seed=0):
    """Source index -> (image, label) as one uninterrupted rank delivers it in ``epoch``: each sample's crop
    and flip are its own (seed, epoch, index)'s, whichever rank, worker or resume delivers it."""
    out, source = {}, folder_source(root)
    with _make(root, 0, 1, seed=seed, drop_last=False) as loader:
        loader.set_epoch(epoch)
        for images, labels in loader:
            for i, image, label in zip(loader.batch_indices, images, labels.tolist(), strict=True):
                assert label == source.label(i), i
                if i in out:  # a stand-in for a broken file: the same pixels as where it is itself
                    assert torch.equal(out[i][0], image) and out[i][1] == label, i
                out[i] = (image, label)
    assert len(out) > N * 0.9
    return out


def _run(loader, reference, stop=None):
    """(batch sizes, delivered source indices) of one pass; each sample's pixels and label checked against
    ``reference``'s for its index."""
    sizes, delivered = [], []
    for k, (images, labels) in enumerate(loader):
        for i, image, label in zip(loader.batch_indices, images, labels.tolist(), strict=True):
            assert torch.equal(image, reference[i][0]) and label == reference[i][1], i
        sizes.append(len(labels))
        delivered += loader.batch_indices
        if stop is not None and k + 1 == stop:
            break
    return sizes, delivered


def _make(root, rank, world, **kw):
    kw = {"batch_size": 8, "image_size": 16, "num_workers": 1, "device": "cpu", "on_error": "skip", "seed": 0, **kw}
    return ImageLoader(root, rank=rank, world_size=world, **kw)


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_rank_yields_the_same_full_batches_whatever_it_skips(tmp_path, drop_last):
    """5 broken files on rank 0's shard, 1 on rank 1's, batch 8: both ranks yield len(loader) batches of the
    same sizes, so neither waits in DDP for a batch the other never makes."""
    src, broken = _dataset(tmp_path)
    reference = _reference(tmp_path, 0)
    runs = []
    for rank in range(2):
        with _make(tmp_path, rank, 2, drop_last=drop_last) as loader:
            sizes, delivered = _run(loader, reference)
            assert len(sizes) == len(loader) == (4 if drop_last else 5)
            assert loader.stats["skipped_count"] == (5, 1)[rank] == loader.stats["repeated"]
            assert not set(delivered) & broken
            runs.append(sizes)
    assert runs[0] == runs[1] and runs[0][:4] == [8, 8, 8, 8]


@pytest.mark.parametrize("broken_on", [(0, 0), (2, 3)])
def test_exactly_once_across_three_ranks(tmp_path, broken_on):
    """70 samples over 3 ranks: every loadable sample is delivered, and nothing more than DistributedSampler's
    padding (2) and one stand-in per skipped file is delivered twice."""
    src, broken = _dataset(tmp_path, broken_on)
    reference = _reference(tmp_path, 0)
    delivered, skipped = [], 0
    for rank in range(3):
        with _make(tmp_path, rank, 3, drop_last=False) as loader:
            sizes, got = _run(loader, reference)
            assert len(sizes) == len(loader) == 3 and sum(sizes) == 24
            delivered += got
            skipped += loader.stats["skipped_count"]
    counts = collections.Counter(delivered)
    assert set(counts) == set(range(N)) - broken
    assert skipped == len(broken) and sum(counts.values()) - len(counts) == 2 + len(broken)


def test_elastic_resume_from_three_ranks_to_two(tmp_path):
    """Three ranks train two batches in lockstep; rank 0's state resumes on two ranks, with another worker
    count: the rest of the epoch, exactly once, with the crops an uninterrupted run gives."""
    _dataset(tmp_path, (0, 0))
    reference = _reference(tmp_path, 1)
    other_epoch = _reference(tmp_path, 0)  # the crops a resume in the wrong epoch would give
    assert sum(not torch.equal(reference[i][0], other_epoch[i][0]) for i in range(N)) >= N - 2
    delivered = []
    for rank in range(3):
        with _make(tmp_path, rank, 3, drop_last=False) as loader:
            loader.set_epoch(1)
            sizes, got = _run(loader, reference, stop=2)
            delivered += got
            if rank == 0:
                state = loader.state_dict()
    assert state["sampler"]["offset"] == 48
    rest = []
    for rank in range(2):
        with _make(tmp_path, rank, 2, drop_last=False, num_workers=2, seed=123) as loader:
            loader.load_state_dict(state)
            rest += _run(loader, reference)[1]
    counts = collections.Counter(delivered + rest)
    assert set(counts) == set(range(N)) and sum(counts.values()) == N  # 22 left: two ranks of 11, no padding
    assert set(rest) == set(range(N)) - set(delivered)


def test_resume_with_another_worker_count_gives_the_same_batches(tmp_path):
    _dataset(tmp_path, (0, 0))
    reference = _reference(tmp_path, 3)
    with _make(tmp_path, 0, 1) as loader:
        loader.set_epoch(3)
        _run(loader, reference, stop=2)
        state = loader.state_dict()
    out = []
    for workers in (1, 2):
        with _make(tmp_path, 0, 1, num_workers=workers) as loader:
            loader.load_state_dict(state)
            out.append([(x, y, list(loader.batch_indices)) for x, y in loader])
            assert all(torch.equal(x[k], reference[i][0]) for x, _, ind in out[-1] for k, i in enumerate(ind))
    assert len(out[0]) == len(out[1]) == 6
    for (xa, ya, ia), (xb, yb, ib) in zip(*out, strict=True):
        assert ia == ib and torch.equal(ya, yb) and torch.equal(xa, xb)


DDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from gpufeed import ImageLoader
dist.init_process_group("gloo")
loader = ImageLoader(sys.argv[1], batch_size=8, image_size=16, num_workers=1, device="cpu", on_error="skip",
                     seed=0, drop_last=sys.argv[2] == "1")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3 * 16 * 16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(2):
    loader.set_epoch(epoch)
    steps = 0
    for images, labels in loader:
        loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
        opt.zero_grad(); loss.backward(); opt.step()  # the all-reduce a rank with fewer batches would leave waiting
        steps += 1
    print(f"rank {dist.get_rank()} epoch {epoch} steps {steps} skipped {loader.stats['skipped_count']}", flush=True)
loader.close()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("drop_last", ["1", "0"])
def test_ddp_training_with_skipped_files_finishes(tmp_path, drop_last):
    _dataset(tmp_path / "data")
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    with socket.socket() as sock:  # a free port, so parallel or repeated runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           "--master_addr=127.0.0.1", str(script), str(tmp_path / "data"), drop_last]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0, res.stderr[-3000:]
    steps = 4 if drop_last == "1" else 5
    for rank, skipped in ((0, 5), (1, 1)):  # epoch 0's order puts 5 broken files on rank 0, 1 on rank 1
        assert f"rank {rank} epoch 0 steps {steps} skipped {skipped}" in res.stdout, res.stdout
        assert f"rank {rank} epoch 1 steps {steps}" in res.stdout, res.stdout


NODE_SCRIPT = """
import os, sys, torch.distributed as dist
from gpufeed import ImageLoader
dist.init_process_group("gloo")
loader = ImageLoader(sys.argv[1], batch_size=5, image_size=16, device="cpu", drop_last=False)
seen = [i for _ in loader for i in loader.batch_indices]
print(f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']} of "
      f"{os.environ['LOCAL_WORLD_SIZE']} workers {loader.num_workers} cores {len(os.sched_getaffinity(0))} "
      f"samples {','.join(map(str, seen))}", flush=True)
loader.close()
dist.destroy_process_group()
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="two 'hosts' of different core counts need CPU affinity and two CPUs")
def test_two_torchrun_nodes_of_different_core_counts(tmp_path):
    """torchrun --nnodes=2 on one host, the first node held to one CPU: the epoch is sharded over the global
    ranks (each sample once), and each node sizes its workers from its own cores and local ranks."""
    _dataset(tmp_path / "data", (0, 0))
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cores = sorted(os.sched_getaffinity(0))
    nodes = []
    for node, cpus in ((0, {cores[0]}), (1, set(cores))):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=1", f"--master_port={port}", "--master_addr=127.0.0.1", str(script),
               str(tmp_path / "data")]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      preexec_fn=lambda cpus=cpus: os.sched_setaffinity(0, cpus)))
    outs = [p.communicate(timeout=180) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    lines = [outs[0][0].strip(), outs[1][0].strip()]
    assert lines[0].startswith("rank 0 of 2 local 0 of 1 workers 1 cores 1 ")
    assert lines[1].startswith(f"rank 1 of 2 local 0 of 1 workers {len(cores)} cores {len(cores)} ")
    samples = [int(i) for line in lines for i in line.rsplit(" ", 1)[1].split(",")]
    assert sorted(samples) == list(range(N))  # 70 over 2 ranks: 35 each, no padding
