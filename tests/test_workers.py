"""The worker pool and processes: what they write into the ring on each path, which CPUs and priority they
run at, what they start with, and what a failed start leaves behind."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from gpufeed.augment.params import AugmentSpec
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.placement import cpu_cost, engine_cost
from gpufeed.ring import KIND_BYTES, KIND_PIXELS, KIND_ROWS, Meta
from gpufeed.sources import FileSource, folder_source
from gpufeed.workers import PipelineSpec, WorkerError, WorkerPool
from gpufeed.workers.chunks import inspect_sample
from tests.helpers import shared_memory_mapped


def pool_spec(src, capacity=1 << 20, size=16, **kw):
    """A GPU-path spec (``capacity`` > 0: JPEGs stay encoded) at image size ``size``."""
    return PipelineSpec(src, AugmentSpec(image_size=size, resize_size=size), 10**8, gpu_bytes_capacity=capacity,
                        gpu_buffer_bytes=1 << 20, **kw)


def _pool_batch(root, capacity=1 << 20, size=16, cpu_rows=0):
    src = folder_source(root)
    pool = WorkerPool(pool_spec(src, capacity, size), num_workers=2, num_slots=2, batch_size=len(src))
    pool.submit(0, 0, 0, 0, list(range(len(src))), cpu_rows=cpu_rows)
    view, failures = pool.collect(0)
    assert failures == []
    return src, pool, view


def test_workers_leave_jpegs_encoded_and_finish_odd_files(coloured):
    src, pool, view = _pool_batch(coloured)
    kinds = view.meta[:, Meta.KIND].tolist()
    png = [i for i in range(len(src)) if src.path(i).endswith("png.jpg")][0]
    assert kinds[png] == KIND_PIXELS and kinds.count(KIND_BYTES) == len(src) - 1
    for i in range(len(src)):
        if kinds[i] == KIND_BYTES:
            assert view.arena[i, : view.meta[i, Meta.LENGTH]].tobytes() == src.read(i)
            w, h = Image.open(src.path(i)).size
            assert tuple(view.meta[i, Meta.WIDTH : Meta.HEIGHT + 1]) == (w, h)
    assert view.images[png].mean() > 0  # cropped by the worker
    pool.close()


def test_files_over_the_capacity_are_decoded_by_the_workers(coloured):
    src, pool, view = _pool_batch(coloured, capacity=100)
    assert (view.meta[:, Meta.KIND] == KIND_PIXELS).all()
    pool.close()


def test_the_cpu_share_goes_to_the_cheapest_samples_of_each_chunk(coloured):
    src, pool, view = _pool_batch(coloured, cpu_rows=5)
    n, chunk, spec = len(src), pool.chunk_size, pool_spec(src)
    on_cpu = set(np.flatnonzero(view.meta[:, Meta.KIND] != KIND_BYTES).tolist())
    expected = set()
    for a in range(0, n, chunk):  # 5 rows spread over the chunks; in each, the PNG first, then the cheapest
        b = min(a + chunk, n)
        quota = round(5 * b / n) - round(5 * a / n)
        seen = [inspect_sample(spec, CpuDecoder(), 0, 0, i) for i in range(a, b)]
        forced = {a + j for j, s in enumerate(seen) if not s.gpu_ok}
        costs = sorted((cpu_cost(s.candidate) / engine_cost(s.candidate), a + j) for j, s in enumerate(seen)
                       if s.gpu_ok)
        expected |= forced | {i for _, i in costs[: max(0, quota - len(forced))]}
    png = [i for i in range(n) if src.path(i).endswith("png.jpg")][0]
    assert on_cpu == expected and png in on_cpu and len(on_cpu) in (5, 6)  # 6: the PNG's chunk had no quota
    for i in on_cpu:  # decoded: cropped and resized (pixels), or the crop's rows left for the GPU
        kind, length = view.meta[i, Meta.KIND : Meta.LENGTH + 1]
        assert (view.images[i].max() if kind == KIND_PIXELS else view.rooms[i, :length].max()) > 0
    pool.close()


def test_the_structural_check_keeps_progressive_jpegs_off_the_gpu(tmp_path):
    (tmp_path / "a").mkdir()
    rng = np.random.default_rng(0)
    for name, progressive in (("p.jpg", True), ("s.jpg", False)):
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), np.uint8)).save(tmp_path / "a" / name, quality=90,
                                                                          progressive=progressive)
    src = folder_source(tmp_path)
    pool = WorkerPool(pool_spec(src), num_workers=1, num_slots=1, batch_size=2)
    try:
        pool.submit(0, 0, 0, 0, [0, 1])
        view, failures = pool.collect(0)
        assert failures == []
        assert view.meta[:, Meta.KIND].tolist() == [KIND_PIXELS, KIND_BYTES]  # p.jpg, s.jpg
    finally:
        pool.close()


@pytest.mark.parametrize("cpu_rows", [0, 7])
def test_gpu_path_workers_report_a_broken_file_and_place_the_rest(coloured, cpu_rows):
    """A file that cannot even be read as an image, in the middle of a batch: with "skip" it is reported
    (position and path) and every other sample is placed, encoded or decoded, with its label; with
    "raise" the batch fails naming it."""
    (coloured / "c1" / "2.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all")
    src = folder_source(coloured)
    bad = [i for i in range(len(src)) if src.path(i).endswith("c1/2.jpg")][0]
    for policy in ("skip", "raise"):
        pool = WorkerPool(pool_spec(src, on_error=policy), num_workers=2, num_slots=1, batch_size=len(src))
        pool.submit(0, 0, 0, 0, list(range(len(src))), cpu_rows=cpu_rows)
        if policy == "raise":
            with pytest.raises(WorkerError, match="c1/2.jpg"):
                pool.collect(0)
        else:
            view, failures = pool.collect(0)
            assert [(f.position, f.path) for f in failures] == [(bad, src.path(bad))]
            good = [i for i in range(len(src)) if i != bad]
            assert view.labels[good].tolist() == [src.label(i) for i in good]
            kinds = view.meta[good, Meta.KIND]
            assert set(kinds.tolist()) <= {KIND_BYTES, KIND_PIXELS, KIND_ROWS}
            # the PNG is always decoded here and counts in its chunk's quota; the broken file takes none of it
            assert (kinds != KIND_BYTES).sum() == max(1, cpu_rows)
        pool.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_workers_run_on_the_cpus_given(synth_root):
    one = {max(os.sched_getaffinity(0))}
    pool = WorkerPool(PipelineSpec(folder_source(synth_root), AugmentSpec(image_size=32), 10**8), num_workers=2,
                      num_slots=2, batch_size=4, cpus=one)
    try:
        pool.submit(0, 0, 0, 0, [0, 1, 2, 3])
        view, failures = pool.collect(0)  # they started and served a batch there
        assert not failures and view.images.shape[0] == 4
        deadline = time.monotonic() + 30  # a worker that took no chunk yet may still be starting
        while (got := [os.sched_getaffinity(pid) for pid in pool.pids]) != [one, one]:
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
    finally:
        pool.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="lists POSIX shared memory in /dev/shm")
def test_a_worker_that_cannot_start_leaves_no_shared_memory_or_process(synth_root, monkeypatch):
    started, start, made = [], WorkerPool._start, set()
    before = shared_memory_mapped()

    def fail_second(self, i):
        if i == 1:
            made.update(shared_memory_mapped() - before)  # the ring and the file list's blocks, made by now
            raise OSError("pthread_create failed (a stand-in)")
        started.append(start(self, i))
        return started[-1]

    monkeypatch.setattr(WorkerPool, "_start", fail_second)
    with pytest.raises(OSError, match="stand-in"):
        WorkerPool(PipelineSpec(folder_source(synth_root), AugmentSpec(image_size=32), 10**8), num_workers=3,
                   num_slots=2, batch_size=4)
    assert len(started) == 1
    started[0].process.join(30)  # returns once it exits; a busy machine may take seconds
    assert started[0].process.exitcode is not None  # the worker that had started is gone
    assert made and made & set(os.listdir("/dev/shm")) == set()  # (the queues' semaphores go with the queues)


_FAULTS = """
import random, resource, sys
from gpufeed.workers.process import keep_heap
if sys.argv[1] == "kept":
    keep_heap()
rng = random.Random(0)
sizes = [rng.randrange(50_000, 600_000) for _ in range(400)]  # a worker's files and decoded crops
for n in sizes[:50]:
    bytes(n)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for n in sizes:
    b = bytes(bytearray(n))  # allocated, written, freed
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_workers_keep_freed_sample_memory_mapped():
    """A worker allocates and frees a file's bytes and a decoded image per sample; with glibc's default
    thresholds every sample faults its pages back in. The workers' heap setting must remove that."""
    faults = {how: int(subprocess.run([sys.executable, "-c", _FAULTS, how], capture_output=True, text=True,
                                      check=True).stdout) for how in ("default", "kept")}
    assert faults["kept"] * 10 < faults["default"], faults


class GatedSource(FileSource):
    """Reading a file of ``gated`` first writes the file ``entered-<index>`` in ``folder``, then waits (a minute
    at most) until the file ``open`` is there."""

    def __init__(self, paths, labels, gated, folder):
        super().__init__(paths, labels)
        object.__setattr__(self, "gated", frozenset(gated))
        object.__setattr__(self, "folder", str(folder))

    def read(self, index):
        if index in self.gated:
            open(os.path.join(self.folder, f"entered-{index}"), "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(self.folder, "open")) and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().read(index)


def _wait_for(path, seconds=60):
    deadline = time.monotonic() + seconds  # workers start at a lower priority: slowly on a busy machine
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


def test_last_wait_is_the_workers_lateness_by_their_own_clock(synth_root, tmp_path):
    """``collect``'s ``last_wait`` (what the CPU share's rule reads) is how long after the ask the workers
    finished the batch: 0 for a batch finished before it was asked for, however late the collecting thread
    came (in the training process it may wait long for the interpreter lock), and no more than the wall
    time of a collect that really waited. The order is made, not waited for: batch 0's reads wait for a file
    made after the ask; batch 1 is finished before its ask, as both workers are inside batch 2's reads."""
    src = folder_source(synth_root)
    source = GatedSource(src.paths, src.labels, gated={0, 1, 2, 3, 8, 9}, folder=tmp_path)
    pool = WorkerPool(PipelineSpec(source, AugmentSpec(image_size=32), 10**8), num_workers=2, num_slots=3,
                      batch_size=4)
    try:
        assert pool.chunk_size == 1  # a chunk per sample: batch 2's two samples are one for each worker
        pool.submit(0, 0, 0, 0, [0, 1, 2, 3])
        opener = threading.Timer(0.5, lambda: (tmp_path / "open").touch())  # after the ask below
        t0 = time.perf_counter()
        opener.start()
        pool.collect(0)
        waited = time.perf_counter() - t0
        assert 0 < pool.last_wait <= waited
        (tmp_path / "open").unlink()
        pool.submit(1, 1, 0, 0, [4, 5, 6, 7])
        pool.submit(2, 2, 0, 0, [8, 9])
        _wait_for(tmp_path / "entered-8")
        _wait_for(tmp_path / "entered-9")  # each worker took a chunk of batch 2: it had finished its batch 1
        pool.collect(1)
        assert pool.last_wait == 0.0
        (tmp_path / "open").touch()
        pool.collect(2)
    finally:
        pool.close()


def _hold_and_clear(progress, stop):
    i = 0
    while not stop.is_set():
        progress.hold(i % 7, 1, 2, 1000.0 + i)
        progress.clear()
        i += 1


def test_a_sample_in_hand_is_never_read_without_its_time():
    """A worker writes its sample-in-hand record while the pool reads it: a read must never see a held sample
    with the idle record's time (0), which looks held since the machine started and gets the worker stopped
    for sample_timeout. Written one value at a time without a sequence number, about one read in ten tore."""
    import multiprocessing as mp

    from gpufeed.workers.records import Progress

    ctx = mp.get_context("spawn")
    progress, stop = Progress.create(ctx), ctx.Event()
    writer = ctx.Process(target=_hold_and_clear, args=(progress, stop))
    writer.start()
    try:
        reads = held = torn = 0
        while held < 20_000 and reads < 5_000_000:  # the writer started: enough reads while it writes
            hand = progress.read()
            reads += 1
            if hand is not None:
                held += 1
                torn += hand.since < 1000 or hand.position != 2 or hand.chunk_id != 1
    finally:
        stop.set()
        writer.join(timeout=30)
    assert held >= 20_000 and torn == 0, (reads, held, torn)


def test_each_gpu_path_position_carries_its_own_samples_draw(coloured):
    """Seed 5, epoch 2, the samples in another order than the source's: every JPEG left encoded carries the
    box and flip ``AugmentSpec.draw`` gives its own index, and every one decoded to rows (the CPU's share, at a
    size whose pixel room holds their rows) its flip."""
    src = folder_source(coloured)
    spec = pool_spec(src, size=48)
    pool = WorkerPool(spec, num_workers=2, num_slots=2, batch_size=len(src))
    indices = list(range(len(src)))[::-1]
    try:  # the view reads the pool's shared memory: checked before the pool closes
        pool.submit(0, 0, 5, 2, indices, cpu_rows=4)
        view, failures = pool.collect(0)
        assert failures == []
        kinds = view.meta[:, Meta.KIND].tolist()
        assert kinds.count(KIND_BYTES) >= 6 and kinds.count(KIND_ROWS) >= 2
        flips = set()
        for k, index in enumerate(indices):
            assert view.labels[k] == src.label(index)
            if kinds[k] == KIND_PIXELS:
                continue
            w, h = Image.open(src.path(index)).size
            box = spec.augment.draw(w, h, seed=5, epoch=2, index=index)
            assert view.meta[k, Meta.FLIP] == box.flip, (k, index)
            flips.add(box.flip)
            if kinds[k] == KIND_BYTES:
                assert tuple(view.meta[k, Meta.BOX_X : Meta.BOX_H + 1]) == (box.x, box.y, box.width, box.height)
        assert flips == {False, True}
    finally:
        pool.close()


def test_cpu_path_samples_land_at_their_own_positions(coloured):
    """CPU path: a batch spread over chunks and workers, then a few samples loaded again from position 5 on
    (as a batch's retried or refilled samples are): every position holds its own sample's label and the
    pixels ``load_sample_into`` makes of it alone; the positions before 5 keep theirs."""
    from gpufeed.workers.chunks import load_sample_into

    src = folder_source(coloured)
    spec = PipelineSpec(src, AugmentSpec(image_size=16, resize_size=16), 10**8)
    pool = WorkerPool(spec, num_workers=2, num_slots=2, batch_size=len(src))
    one = np.empty((16, 16, 3), np.uint8)

    def loaded(batch_id):  # copies: a failure's report never reads the pool's shared memory once it is closed
        view, failures = pool.collect(batch_id)
        assert failures == []
        return view.labels.copy(), view.images.copy()

    def check(labels, images, indices):
        assert len(labels) == len(indices)
        for k, index in enumerate(indices):
            assert labels[k] == src.label(index), (k, index)
            load_sample_into(spec, CpuDecoder(), 3, 1, index, one)
            assert np.array_equal(images[k], one), (k, index)

    first, again = list(range(len(src)))[::-1], [0, 6, 11]
    try:
        pool.submit(0, 1, 3, 1, first)
        check(*loaded(0), first)
        pool.submit(1, 1, 3, 1, again, start=5)
        check(*loaded(1), first[:5] + again)
    finally:
        pool.close()
