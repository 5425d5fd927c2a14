import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed import ImageLoader, WorkerError
from tests.helpers import textured

COLOURS = [(220, 30, 30), (30, 220, 30), (30, 30, 220), (220, 220, 30)]


@pytest.fixture(scope="module")
def coloured_root(tmp_path_factory):
    """Each class a distinct colour over texture, sizes varied: the delivered pixels' mean colour tells the
    label, and two crops of an image differ."""
    root = tmp_path_factory.mktemp("coloured")
    rng = np.random.default_rng(0)
    for c, colour in enumerate(COLOURS):
        (root / f"c{c}").mkdir()
        for i in range(9):
            size = (int(rng.integers(40, 120)), int(rng.integers(40, 120)))
            textured(*size, 10 * c + i, colour).save(root / f"c{c}" / f"{i}.jpg", quality=95)
    textured(50, 60, 99, COLOURS[1]).save(root / "c1" / "extra.png")  # PNG takes the Pillow path
    return root


def make(root, **kw):
    kw = {"batch_size": 8, "image_size": 32, "num_workers": 2, "device": "cpu", **kw}
    return ImageLoader(root, **kw)


def _colour_labels(images):
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    rgb = ((images.float() * std + mean) * 255).mean(dim=(2, 3))
    dists = torch.cdist(rgb, torch.tensor(COLOURS, dtype=torch.float32))
    return dists.argmin(dim=1)


def test_batches_shapes_labels_aligned(coloured_root):
    with make(coloured_root, drop_last=False) as loader:
        assert len(loader) == 5  # 37 samples, batch 8
        seen = 0
        for images, labels in loader:
            assert images.dtype == torch.float32 and images.shape[1:] == (3, 32, 32)
            assert labels.dtype == torch.int64
            assert torch.equal(_colour_labels(images), labels)
            seen += len(labels)
        assert seen == 37


def test_channels_last_and_bf16(coloured_root):
    with make(coloured_root, dtype=torch.bfloat16, channels_last=True) as loader:
        images, labels = next(iter(loader))
        assert images.dtype == torch.bfloat16 and images.is_contiguous(memory_format=torch.channels_last)
        assert len(loader) == 4  # drop_last


def test_same_seed_same_batches_and_epochs_differ(synth_root):
    with make(synth_root, seed=3) as a, make(synth_root, seed=3) as b:
        xa = [x for x, _ in a]
        xb = [x for x, _ in b]
        assert len(xa) == len(xb) == 5 and all(torch.equal(p, q) for p, q in zip(xa, xb))
        xa2 = [x for x, _ in a]  # the next epoch: new order and crops
        assert not torch.equal(xa[0], xa2[0])


def test_resume_mid_epoch_yields_exactly_the_rest_then_the_next_epoch_whole(synth_root):
    with make(synth_root, seed=1) as ref:
        ref.set_epoch(2)
        full = [(x, y) for x, y in ref]
        following = [(x, y, list(ref.batch_indices)) for x, y in ref]  # epoch 3, run on by itself
    with make(synth_root, seed=1) as first:
        first.set_epoch(2)
        for i, _ in enumerate(first):
            if i == 1:
                break
        state = first.state_dict()
    with make(synth_root, seed=99) as resumed:
        resumed.load_state_dict(state)
        rest = [(x, y) for x, y in resumed]
        after = [(x, y, list(resumed.batch_indices)) for x, y in resumed]
    assert len(full) == 5 and len(rest) == len(full) - 2
    for (x, y), (rx, ry) in zip(full[2:], rest, strict=True):
        assert torch.equal(y, ry) and torch.equal(x, rx)
    assert len(after) == len(following) == 5  # the epoch after a resume is whole: every sample, the same order
    for (x, y, i), (ax, ay, ai) in zip(following, after, strict=True):
        assert i == ai and torch.equal(y, ay) and torch.equal(x, ax)


def test_break_then_iterate_again(synth_root):
    with make(synth_root) as loader:
        for i, _ in enumerate(loader):
            if i == 0:
                break
        assert sum(len(y) for _, y in loader) == 40 - 8  # the rest of the epoch


def test_a_later_iteration_ends_the_live_one_and_no_batch_is_mislabelled(coloured_root):
    """``peek = iter(loader); next(peek)`` kept while a training loop iterates the loader: the loop takes
    over from where peek's batch left the epoch, every image comes once with its own label (each class its
    colour: the pixels tell the label), and peek raises if used again."""
    with make(coloured_root, drop_last=False, batch_size=5) as loader:
        peek = iter(loader)
        images, labels = next(peek)
        assert torch.equal(_colour_labels(images), labels)
        seen = list(loader.batch_indices)
        for images, labels in loader:
            assert torch.equal(_colour_labels(images), labels)
            seen += loader.batch_indices
        assert sorted(seen) == list(range(len(loader.source)))
        with pytest.raises(RuntimeError, match="ended by a later iter"):
            next(peek)
        assert sum(len(y) for _, y in loader) == len(loader.source)  # the next epoch, whole


def test_every_validation_iteration_is_a_whole_pass_unless_a_state_placed_it(coloured_root):
    """A peek (``next(iter(loader))``) or a ``break`` before a validation pass would otherwise score part of
    the set; a state loaded mid-pass is where the next pass goes on."""
    with make(coloured_root, train=False, drop_last=False, batch_size=5) as loader:
        next(iter(loader))
        seen = []
        for images, labels in loader:
            assert torch.equal(_colour_labels(images), labels)
            seen += loader.batch_indices
        assert seen == list(range(len(loader.source)))
        for i, _ in enumerate(loader):
            if i == 2:
                state = loader.state_dict()
                break
        assert sum(len(y) for _, y in loader) == len(loader.source)
        loader.load_state_dict(state)
        rest = []
        for _ in loader:
            rest += loader.batch_indices
        assert rest == list(range(15, len(loader.source)))
        assert sum(len(y) for _, y in loader) == len(loader.source)  # placed once: the next pass is whole


def test_a_loader_live_in_one_thread_is_refused_to_another(coloured_root):
    import threading

    with make(coloured_root, train=False, drop_last=False, batch_size=5) as loader:
        it = iter(loader)
        next(it)
        found = []

        def other() -> None:
            try:
                iter(loader)
            except RuntimeError as e:
                found.append(str(e))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert found and "is being iterated in another thread" in found[0]
        assert 5 + sum(len(y) for _, y in it) == len(loader.source)  # the live one went on, untouched


def test_next_on_one_iteration_from_two_threads_at_once_is_refused(tmp_path):
    import threading

    from .slow_source import SleepySource

    paths = []
    for i in range(2):
        paths.append(tmp_path / f"{i}.jpg")
        Image.new("RGB", (20, 20), COLOURS[i]).save(paths[-1])
    with ImageLoader(SleepySource(paths, [0, 1]), batch_size=1, image_size=16, device="cpu", num_workers=1,
                     train=False, drop_last=False) as loader:
        it = iter(loader)
        t = threading.Thread(target=lambda: next(it))  # waits about 1.5 s for its first batch
        t.start()
        time.sleep(0.5)
        with pytest.raises(RuntimeError, match="from two threads at once"):
            next(it)
        t.join()


def test_an_epoch_of_no_batch_is_refused_when_the_loader_is_made(synth_root):
    with pytest.raises(ValueError, match=r"40 samples make no batch of batch_size=64 with drop_last=True, so an "
                                         r"epoch would yield nothing: give a batch_size of at most 40, or "
                                         r"drop_last=False"):
        make(synth_root, batch_size=64)
    with pytest.raises(ValueError, match=r"20 samples on rank 1 of 2 make no batch of batch_size=32"):
        make(synth_root, batch_size=32, rank=1, world_size=2)
    with make(synth_root, batch_size=64, drop_last=False) as loader:  # one short batch
        assert len(loader) == 1 and [len(y) for _, y in loader] == [40]


def test_validation_is_deterministic(synth_root):
    with make(synth_root, train=False, drop_last=False) as loader:
        a = torch.cat([x for x, _ in loader])
        b = torch.cat([x for x, _ in loader])
        assert a.shape[0] == 40 and torch.equal(a, b)


def test_rank_shards_partition_the_epoch(synth_root):
    """Three ranks over 40 samples (not divisible): together they deliver every sample once, plus the two
    that DistributedSampler's padding repeats (the first of the order). Each delivered image tells which
    sample it is: validation crops are deterministic, and the synthetic images all differ."""
    kw = dict(train=False, drop_last=False, image_size=16, batch_size=4)
    with make(synth_root, **{**kw, "batch_size": 40}) as whole:
        (everything, labels), = list(whole)
    key = lambda x: x.numpy().tobytes()
    samples = [key(x) for x in everything]
    assert len(set(samples)) == 40
    delivered = []
    for rank in range(3):
        with make(synth_root, rank=rank, world_size=3, **kw) as loader:
            assert len(loader) == 4  # 14 samples per rank
            got = [key(x) for batch, _ in loader for x in batch]
            assert len(got) == 14
            delivered += got
    assert sorted(delivered) == sorted(samples + samples[:2])


@pytest.mark.parametrize("kw, message", [
    (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
    (dict(device="tpu"), "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (dict(num_workers=0), "num_workers must be >= 1 or None, got 0"),
    (dict(cpu_share=1.5), "cpu_share must be 'auto' or a fraction in [0, 1], got 1.5"),
    (dict(max_gpu_memory=0), "max_gpu_memory must be a number of bytes >= 1 or None, got 0"),
    (dict(decode="dali"), "decode must be one of"),
])
def test_bad_arguments_fail_before_any_work(synth_root, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(synth_root, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_cuda_without_cuda_is_a_clear_error(synth_root):
    with pytest.raises(ValueError, match="CUDA is not available"):
        make(synth_root, device="cuda")


def test_missing_folder_named():
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ImageLoader("/nowhere/at/all", device="cpu")


def test_undecodable_file_raises_naming_it(tmp_path):
    """A broken JPEG (libjpeg-turbo's path) and a file of no format gpufeed reads (Pillow's): the error names
    the file and the option that skips it, and holds no object's address."""
    for root, bad, data in (("ra", "3.jpg", b"\xff\xd8\xff\xe0 garbage"), ("rb", "2.jpg", b"GIF89a then nothing")):
        (tmp_path / root / "a").mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (40, 40), (10, 20, 30)).save(tmp_path / root / "a" / f"{i}.jpg")
        (tmp_path / root / "a" / bad).write_bytes(data)
        with make(tmp_path / root, batch_size=5) as loader:
            with pytest.raises(WorkerError, match=re.escape(bad)) as e:
                list(loader)
        message = str(e.value).split("\n")[0]
        assert "on_error='skip') skips such files" in message and " at 0x" not in message, message
        last = str(e.value).rstrip().split("\n")[-1]  # under the worker's traceback, where a terminal ends
        assert bad in last and "on_error='skip') skips such files" in last, last


def test_dead_worker_is_reported_not_waited_on(synth_root):
    loader = make(synth_root, batch_size=4)
    it = iter(loader)
    next(it)
    os.kill(loader.worker_pids[0], signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"worker 0 \(pid \d+\) exited unexpectedly with code -9"):
        for _ in range(20):
            next(it)
    loader.close()


def test_close_stops_workers(synth_root):
    loader = make(synth_root)
    next(iter(loader))
    pids = loader.worker_pids
    assert pids
    loader.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)


@pytest.mark.parametrize("batches", [2, None])  # broken off, run to the end
def test_a_dropped_loader_stops_its_workers_without_a_garbage_collection(synth_root, batches):
    import gc
    import weakref

    gc.disable()
    try:
        loader = make(synth_root, on_error="skip")
        for i, _ in enumerate(loader):
            if i + 1 == batches:
                break
        pids, ref = loader.worker_pids, weakref.ref(loader)
        del loader, _
        assert ref() is None  # freed by reference counting: nothing it owns refers back to it
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in pids):
            assert time.monotonic() < deadline, pids
            time.sleep(0.05)
    finally:
        gc.enable()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_too_small_dev_shm_is_a_clear_error(tmp_path):
    from gpufeed.ring import check_shm_space

    with pytest.raises(RuntimeError, match=r"has \d+ MB free, the batch ring needs about .*--shm-size"):
        check_shm_space(1 << 60, root=str(tmp_path))
    check_shm_space(1024, root=str(tmp_path))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc")
def test_workers_do_not_reimport_the_users_script(tmp_path, synth_root):
    """A training script imports torch; its workers must not (about 300 MB each otherwise)."""
    import subprocess
    import sys

    script = tmp_path / "train_like.py"
    script.write_text(f"""
import os, torch
from gpufeed import ImageLoader
loader = ImageLoader({str(synth_root)!r}, batch_size=4, image_size=16, num_workers=2, device="cpu")
next(iter(loader))
for pid in loader.worker_pids:
    maps = open(f"/proc/{{pid}}/maps").read()
    print("worker", pid, "libtorch" if "libtorch" in maps else "clean")
loader.close()
""")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [l for l in res.stdout.splitlines() if l.startswith("worker")]
    assert len(lines) == 2 and all(l.endswith("clean") for l in lines), res.stdout


def test_source_class_from_a_notebook_is_a_clear_error(synth_root, monkeypatch):
    import sys
    import types

    from gpufeed.sources import folder_source

    src = folder_source(synth_root)
    Notebook = type("NotebookSource", (type(src),), {"__module__": "__main__"})
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # no __file__, as in Jupyter
    with pytest.raises(ValueError, match="'NotebookSource' is defined in an interactive session"):
        ImageLoader(Notebook(src.paths, src.labels), batch_size=4, image_size=16, num_workers=1, device="cpu")


def test_workers_run_at_a_lower_priority_than_the_training_process(synth_root):
    from gpufeed.workers.process import WORKER_NICE

    loader = make(synth_root)
    next(iter(loader))
    want = [min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICE)] * 2
    deadline = time.monotonic() + 30  # a worker that took no batch yet may still be starting
    while (got := [os.getpriority(os.PRIO_PROCESS, pid) for pid in loader.worker_pids]) != want:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    loader.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_cpu_path_workers_use_the_whole_mask(synth_root):
    loader = make(synth_root)
    assert loader.worker_cpus is None and loader.stats["worker_cpus"] is None
    next(iter(loader))
    assert all(os.sched_getaffinity(pid) == os.sched_getaffinity(0) for pid in loader.worker_pids)
    loader.close()


_THREADS = "import os, numpy, cv2; print(len(os.listdir('/proc/self/task')))"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_workers_start_no_blas_thread_pools(synth_root):
    """numpy's and OpenCV's OpenBLAS each start a thread per core when they load; a worker needs none."""
    from gpufeed.workers.process import SINGLE_THREADED

    env = {k: v for k, v in os.environ.items() if k not in SINGLE_THREADED}
    plain = int(subprocess.run([sys.executable, "-c", _THREADS], env=env, capture_output=True, text=True,
                               check=True).stdout)
    if plain == 1:
        pytest.skip("one core: the libraries start no pools here to compare with")
    loader = make(synth_root)
    next(iter(loader))
    counts = [len(os.listdir(f"/proc/{pid}/task")) for pid in loader.worker_pids]
    loader.close()
    assert all(n <= 3 for n in counts), (counts, plain)  # its main thread, the result queue's feeder, the parent watch


def _epoch(loader):
    return [(x, y) for x, y in loader]


def _same(a, b):
    return len(a) == len(b) > 0 and all(torch.equal(x, p) and torch.equal(y, q) for (x, y), (p, q) in zip(a, b))


def test_epochs_run_back_to_back_equal_fresh_starts(synth_root):
    """An epoch that follows another (its first batches started early, tests/test_schedule.py) is exactly
    what a loader started at that epoch gives, also after ``set_epoch`` names the epoch it moved to."""
    with make(synth_root, seed=5, num_workers=2) as loader:
        first = _epoch(loader)
        second = _epoch(loader)
        loader.set_epoch(2)  # the epoch it moved to by itself
        third = _epoch(loader)
    for e, got in enumerate((first, second, third)):
        with make(synth_root, seed=5, num_workers=2) as fresh:
            fresh.set_epoch(e)
            assert _same(got, _epoch(fresh)), e


def test_early_start_is_dropped_when_another_epoch_or_state_follows(synth_root):
    with make(synth_root, seed=5) as loader, make(synth_root, seed=5) as fresh:
        _epoch(loader)  # epoch 1 now started early
        loader.set_epoch(7)
        fresh.set_epoch(7)
        assert _same(_epoch(loader), _epoch(fresh))
        fresh.set_epoch(3)
        for i, _ in enumerate(fresh):
            if i == 1:
                break
        state = fresh.state_dict()  # epoch 3 after two batches
        loader.load_state_dict(state)  # loader had epoch 8 started early
        rest = _epoch(loader)
        fresh.load_state_dict(state)
        assert len(rest) == len(loader) - 2 and _same(rest, _epoch(fresh))


def test_skips_at_an_epoch_end_with_the_next_epoch_started(tmp_path):
    """A bad file in the last batch cancels the early-started next epoch; both epochs stay exact."""
    for c, colour in enumerate(COLOURS[:2]):
        (tmp_path / f"c{c}").mkdir()
        for i in range(10):
            textured(48, 40, 10 * c + i, colour).save(tmp_path / f"c{c}" / f"{i}.jpg")
    (tmp_path / "c1" / "zz_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    with make(tmp_path, batch_size=4, drop_last=False, on_error="skip", train=False) as loader:
        for epoch in range(3):
            got = _epoch(loader)
            labels = torch.cat([y for _, y in got])
            # validation: the bad one left out; the last batch, which held it alone, is not yielded
            assert len(got) == len(loader) - 1 == 5 and len(labels) == 20, epoch
            assert all(torch.equal(_colour_labels(x), y) for x, y in got)
        assert loader.stats["skipped_count"] == 3


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_cpu_device_gives_the_same_batches_whoever_normalises(tmp_path, synth_root, channels_last):
    """From WORKERS_NORMALISE_FROM workers a CPU device's workers normalise (BENCHMARKS.md#cpu-only-machines),
    below that the main process does: the same seed gives the same batches to the bit, stand-ins for a
    skipped file included."""
    import shutil

    from gpufeed import placement

    root = tmp_path / "data"
    shutil.copytree(synth_root, root)
    broken = sorted(root.glob("*/*.jpg"))[5]
    broken.write_bytes(broken.read_bytes()[:300])  # truncated: skipped, another image stands in
    kw = dict(batch_size=8, image_size=32, device="cpu", seed=3, on_error="skip", channels_last=channels_last)
    few = ImageLoader(root, num_workers=2, **kw)
    many = ImageLoader(root, num_workers=placement.WORKERS_NORMALISE_FROM, **kw)
    assert few.spec.normalize is None and many.spec.normalize is not None
    compared = 0
    for (xa, ya), (xb, yb) in zip(few, many, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb) and xa.stride() == xb.stride()
        compared += 1
    assert compared == len(few) == 5
    assert len(few.stats["skipped"]) == len(many.stats["skipped"]) == 1 and few.stats["repeated"] == 1
    few.close(), many.close()


def test_a_batch_transform_gets_each_finished_batch_as_torchvision_would(synth_root):
    """``batch_transform`` (torchvision's MixUp, CutMix, a RandomChoice of them) runs on each finished batch
    in the loader, drawn from its seed: torchvision's transform given the same draw gives the same batch from
    the plain loader's, labels (B, num_classes) float."""
    from torchvision.transforms import v2

    from gpufeed.augment.params import SampleRandom

    kw = dict(batch_size=8, image_size=32, device="cpu", num_workers=2, seed=5)
    plain = ImageLoader(synth_root, **kw)
    for transform in (v2.MixUp(num_classes=4, alpha=1.0), v2.CutMix(num_classes=4, alpha=1.0),
                      v2.RandomChoice([v2.MixUp(num_classes=4), v2.CutMix(num_classes=4)])):
        mixed = ImageLoader(synth_root, batch_transform=transform, **kw)
        mix = mixed.batch_mix
        plain.set_epoch(0)  # the plain loader moved on to the next epoch after the last round
        compared, kinds = 0, set()
        it = iter(mixed)
        for x, y in plain:
            xm, ym = next(it)
            assert mixed.batch_indices == plain.batch_indices
            drawn = mix.draw(SampleRandom(5 ^ mix.salt, 0, plain.batch_indices[0]), 32, 32)
            kinds.add(drawn.kind)
            expected_x, expected_y = _torchvision_with(transform, drawn)(x, y)
            assert ym.shape == (8, 4) and ym.dtype == torch.float32
            torch.testing.assert_close(ym.sum(dim=1), torch.ones(8))
            assert torch.equal(xm, expected_x) and torch.equal(ym, expected_y)
            assert not torch.equal(xm, x)  # something was mixed in
            compared += 1
        assert compared == len(plain) == 5
        assert kinds == {type(t).__name__ for t in getattr(transform, "transforms", [transform])}
        mixed.close()
    plain.close()
    with pytest.raises(TypeError, match="batch_transform must be callable"):
        ImageLoader(synth_root, batch_transform="mixup", **kw)


def _torchvision_with(transform, drawn):
    """torchvision's own MixUp or CutMix (out of ``transform``), made to use ``drawn`` (a ``Mix``)."""
    parts = getattr(transform, "transforms", [transform])
    t = next(p for p in parts if type(p).__name__ == drawn.kind)
    params = {"lam": drawn.lam} if drawn.kind == "MixUp" else {"box": drawn.box, "lam_adjusted": drawn.lam}
    t.make_params = lambda flat_inputs: params
    return t


def test_options_that_cannot_apply_are_said_once_when_the_loader_is_made(synth_root):
    """cpu_share without GPU decode, max_gpu_memory without a GPU: a warning each, naming the option."""
    import warnings

    with pytest.warns(UserWarning, match=r"cpu_share=0.5 has no effect: every sample is decoded by the CPU"):
        ImageLoader(synth_root, batch_size=4, image_size=16, num_workers=1, device="cpu", cpu_share=0.5).close()
    with pytest.warns(UserWarning, match=r"max_gpu_memory=1000000000 has no effect on device 'cpu'"):
        ImageLoader(synth_root, batch_size=4, image_size=16, num_workers=1, device="cpu",
                    max_gpu_memory=10**9).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults say nothing
        ImageLoader(synth_root, batch_size=4, image_size=16, num_workers=1, device="cpu").close()


def test_validation_under_skip_keeps_each_image_with_its_label_when_a_bad_one_leaves_mid_batch(tmp_path):
    """Two classes of textured images in validation's order, a bad file in the middle of the batch where the
    classes meet: the batch comes one smaller, and every image delivered equals that image from a folder
    without the bad file, with its own label."""
    import shutil

    from tests.corpus import jpeg

    for c, n in ((0, 6), (1, 5)):
        (tmp_path / "all" / f"c{c}").mkdir(parents=True)
        for i in range(n):
            (tmp_path / "all" / f"c{c}" / f"{i}.jpg").write_bytes(jpeg(40 + 3 * i, 30 + c, seed=10 * c + i))
    shutil.copytree(tmp_path / "all", tmp_path / "good")
    (tmp_path / "all" / "c0" / "5.jpg").write_bytes(b"not an image at all")  # index 5: batch [4, 5, 6, 7]
    (tmp_path / "good" / "c0" / "5.jpg").unlink()
    kw = dict(batch_size=4, image_size=16, num_workers=2, device="cpu", train=False, drop_last=False)
    with ImageLoader(tmp_path / "good", **kw) as good:
        expected = {}
        for images, labels in good:
            for k, i in enumerate(good.batch_indices):
                expected[good.source.path(i).split("good")[1]] = (images[k], int(labels[k]))
    with ImageLoader(tmp_path / "all", on_error="skip", **kw) as val:
        sizes = []
        for images, labels in val:
            sizes.append(len(images))
            for k, i in enumerate(val.batch_indices):
                image, label = expected[val.source.path(i).split("all")[1]]
                assert int(labels[k]) == label == val.source.label(i) and torch.equal(images[k], image)
    assert sizes == [4, 3, 3] and val.stats["skipped_count"] == 1


def test_validation_under_skip_leaves_a_bad_image_out_instead_of_repeating_a_good_one(tmp_path):
    """Validation counts each image once: a file that cannot be decoded leaves its batch (smaller then), where
    training would put a good sample of the batch in its place."""
    from tests.corpus import jpeg

    for c in range(2):
        (tmp_path / f"c{c}").mkdir()
        for i in range(5):
            (tmp_path / f"c{c}" / f"{i}.jpg").write_bytes(jpeg(40 + i, 30, seed=10 * c + i))
    (tmp_path / "c1" / "2.jpg").write_bytes(b"not an image at all")
    kw = dict(batch_size=4, image_size=16, num_workers=1, device="cpu", on_error="skip")
    with ImageLoader(tmp_path, train=False, **kw) as val:
        sizes, seen, labels = [], [], []
        for images, y in val:
            sizes.append(len(images))
            seen += val.batch_indices
            labels += y.tolist()
        bad = [i for i in range(10) if val.source.path(i).endswith("c1/2.jpg")]
        assert sorted(seen) == [i for i in range(10) if i not in bad]  # each good image once, the bad one out
        assert sizes == [4, 3, 2] and labels == [val.source.label(i) for i in seen]
        assert val.stats["skipped_count"] == 1 and val.stats["repeated"] == 0
    with ImageLoader(tmp_path, train=True, **kw) as train:
        sizes = [len(images) for images, _ in train]
        assert sizes == [4, 4] and train.stats["repeated"] == 1  # training keeps its batches full


@pytest.mark.parametrize("kw, message", [
    ({"image_size": (128, 96)}, r"image_size must be one integer \(the loader makes square images\), got \(128, 96\): "
                                r"give one side, e.g. image_size=128"),
    ({"image_size": "224"}, r"image_size must be one integer .* got '224'$"),
    ({"resize_size": 256.0}, r"resize_size must be one integer .* got 256.0$"),
])
def test_a_size_that_is_not_one_integer_is_named(coloured_root, kw, message):
    with pytest.raises(TypeError, match=message):
        make(coloured_root, **kw)


def test_a_validation_state_saved_after_a_batch_that_left_a_bad_image_out_resumes_after_that_batch(tmp_path):
    """The position counts the entries of the order a batch took, not the images it delivered: a state saved
    after a validation batch that left a bad file out goes on with the next batch, repeating none of its
    images."""
    from tests.corpus import jpeg

    for c in range(2):
        (tmp_path / f"c{c}").mkdir()
        for i in range(5):
            (tmp_path / f"c{c}" / f"{i}.jpg").write_bytes(jpeg(40 + i, 30, seed=10 * c + i))
    (tmp_path / "c0" / "1.jpg").write_bytes(b"not an image at all")  # index 1: in the first batch, [0, 1, 2, 3]
    kw = dict(batch_size=4, image_size=16, num_workers=1, device="cpu", train=False, drop_last=False,
              on_error="skip")
    with ImageLoader(tmp_path, **kw) as val:
        batches = iter(val)
        _, labels = next(batches)
        first = list(val.batch_indices)
        assert len(labels) == 3 and 1 not in first
        state = val.state_dict()
        assert state["sampler"]["offset"] == 4
    with ImageLoader(tmp_path, **kw) as resumed:
        resumed.load_state_dict(state)
        rest = []
        for _ in resumed:
            rest += resumed.batch_indices
        assert rest == list(range(4, 10))


def test_set_epoch_starts_a_training_epoch_over_unless_a_state_placed_it(coloured_root):
    """A peek or a break leaves a training epoch part-taken: the next ``for`` goes on (said once), and
    ``set_epoch`` of that epoch starts it over; after ``load_state_dict`` the resumed position is kept."""
    with make(coloured_root, drop_last=False, batch_size=5) as loader:
        n = len(loader.source)
        loader.set_epoch(0)
        next(iter(loader))
        with pytest.warns(UserWarning, match=r"goes on with epoch 0 where the last one stopped \(5 of its 37 samples"):
            assert sum(len(y) for _, y in loader) == n - 5
        for i, _ in enumerate(loader):  # epoch 1, broken off: said once only
            if i == 1:
                break
        import warnings as w

        with w.catch_warnings():
            w.simplefilter("error")
            for _ in loader:
                state = loader.state_dict()
                break
        loader.set_epoch(1)
        seen = []
        for _ in loader:
            seen += loader.batch_indices
        assert sorted(seen) == list(range(n))  # over from its start
        loader.load_state_dict(state)
        loader.set_epoch(1)  # as a resumed loop calls it: the placed position is kept
        assert sum(len(y) for _, y in loader) == n - 15
