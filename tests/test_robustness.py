"""Odd and broken images on the CPU path: each kind its own case, so a failure names the kind."""

import contextlib
import logging
import os
import time

import numpy as np
import psutil
import pytest
import torch

from gpufeed import ImageLoader, WorkerError
from gpufeed.decode import CpuDecoder, DecodeError
from gpufeed.decode.exif import apply_orientation, read_orientation
from gpufeed.sources import FileSource
from tests.corpus import DECODABLE, UNDECODABLE, reference_rgb
from tests.helpers import psnr, shared_memory_mapped, textured


def _decode(data, path="f.jpg", exif=False):
    dec = CpuDecoder()
    _, _, fast = dec.header(data, path)
    img = dec.decode(data, path, fast=fast)
    return apply_orientation(img, read_orientation(data)) if exif else img


@pytest.mark.parametrize("kind", sorted(DECODABLE))
def test_decodable_kinds_match_the_pillow_reference(kind):
    data = DECODABLE[kind]()
    out = _decode(data)
    ref = reference_rgb(data)
    assert out.shape == ref.shape and out.dtype == np.uint8
    assert psnr(out, ref) >= 40, kind  # libjpeg-turbo both; only IDCT/upsampling details may differ


@pytest.mark.parametrize("kind", sorted(UNDECODABLE))
def test_undecodable_kinds_raise_naming_the_file(kind):
    import tracemalloc

    data = UNDECODABLE[kind]()
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError) as info:
            _decode(data, f"/data/{kind}.jpg")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"/data/{kind}.jpg" in str(info.value)
    assert peak < 16 << 20, peak  # header bombs are refused from the header, before any pixel buffer exists


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillow_exif_transpose(orientation):
    from tests.corpus import _exif

    data = _exif(orientation)
    assert read_orientation(data) == orientation
    np.testing.assert_array_equal(_decode(data, exif=True), reference_rgb(data, exif_orientation=True))
    assert _decode(data).shape == (40, 80, 3)  # ignored by default


def test_malformed_exif_reads_as_no_rotation():
    from tests.corpus import _malformed_exif

    assert read_orientation(_malformed_exif()) == 1


# ---- the loader: skip policy, labels aligned, counts exact -------------------------------------------


def _mixed_dataset(tmp_path, bad_kinds, good_per_class=6):
    """Classes of distinct tints over texture (the mean colour names the class; two crops of one image differ);
    broken files spread over the classes."""
    colours = [(220, 40, 40), (40, 220, 40), (40, 40, 220)]
    for c, colour in enumerate(colours):
        (tmp_path / f"c{c}").mkdir()
        for i in range(good_per_class):
            textured(48 + 4 * i, 40, seed=10 * c + i, tint=colour).save(tmp_path / f"c{c}" / f"good{i}.jpg",
                                                                        quality=95)
    for j, kind in enumerate(bad_kinds):
        (tmp_path / f"c{j % 3}" / f"bad_{kind}.jpg").write_bytes(UNDECODABLE[kind]())
    return colours


def _colour_labels(images, colours):
    m, s = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1), torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1)
    rgb = ((images.float() * s + m) * 255).mean(dim=(2, 3))
    return torch.cdist(rgb, torch.tensor(colours, dtype=torch.float32)).argmin(dim=1)


def test_skip_keeps_labels_aligned_batches_full_and_counts_exact(tmp_path, caplog):
    bad = sorted(UNDECODABLE)
    colours = _mixed_dataset(tmp_path, bad)
    loader = ImageLoader(tmp_path, batch_size=5, image_size=16, num_workers=2, device="cpu", on_error="skip",
                         drop_last=False)
    n = 18 + len(bad)
    good = {i for i in range(n) if "good" in loader.source.path(i)}
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        sizes, delivered = [], []
        for images, labels in loader:
            assert torch.equal(_colour_labels(images, colours), labels)
            assert [loader.source.label(i) for i in loader.batch_indices] == labels.tolist()
            sizes.append(len(labels))
            delivered += loader.batch_indices
    # as many full batches as without bad files; every good sample delivered, stand-ins in place of the bad
    assert len(sizes) == len(loader) and sizes[:-1] == [5] * (len(sizes) - 1) and sum(sizes) == n
    assert set(delivered) == good and len(delivered) == n
    stats = loader.stats
    assert stats["skipped_count"] == stats["repeated"] == len(bad) == len(delivered) - len(set(delivered))
    assert sorted(os.path.basename(p) for p, _ in stats["skipped"]) == sorted(f"bad_{k}.jpg" for k in bad)
    lines = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and f"skipped {len(bad)} undecodable" in lines[0].getMessage()
    loader.close()


def test_skip_then_resume_yields_exactly_the_rest(tmp_path):
    _mixed_dataset(tmp_path, ["junk", "truncated_scan"])
    kw = dict(batch_size=4, image_size=16, num_workers=2, device="cpu", on_error="skip", seed=5)
    with ImageLoader(tmp_path, **kw) as ref:
        full = [(x, y, list(ref.batch_indices)) for x, y in ref]
    with ImageLoader(tmp_path, **kw) as first:
        head = []
        for i, (x, y) in enumerate(first):
            head.append((x, y, list(first.batch_indices)))
            if i == 1:
                break
        state = first.state_dict()
    with ImageLoader(tmp_path, **kw) as resumed:
        resumed.load_state_dict(state)
        rest = [(x, y, list(resumed.batch_indices)) for x, y in resumed]
    assert len(head + rest) == len(full) == 5
    for (x, y, ind), (fx, fy, find) in zip(head + rest, full, strict=True):  # the same crops, labels, samples
        assert ind == find and torch.equal(y, fy) and torch.equal(x, fx)
    crops = torch.cat([x for x, _, _ in full])
    assert len({c.numpy().tobytes() for c in crops}) == len(crops) - 2  # two stand-ins, the rest all distinct


def test_raise_names_the_file(tmp_path):
    _mixed_dataset(tmp_path, ["truncated_scan"])
    with ImageLoader(tmp_path, batch_size=4, image_size=16, num_workers=2, device="cpu") as loader:
        with pytest.raises(WorkerError, match="bad_truncated_scan.jpg"):
            list(loader)


def test_unreadable_and_vanished_files_follow_the_policy(tmp_path):
    _mixed_dataset(tmp_path, [])
    (tmp_path / "c0" / "dangling.jpg").symlink_to(tmp_path / "nowhere.jpg")  # unreadable (as root, chmod is not)
    gone = tmp_path / "c1" / "vanishes.jpg"
    gone.write_bytes(b"\xff\xd8\xff")
    (tmp_path / "c2" / "link.jpg").symlink_to(tmp_path / "c2" / "good0.jpg")
    loader = ImageLoader(tmp_path, batch_size=4, image_size=16, num_workers=2, device="cpu", on_error="skip",
                         drop_last=False)
    gone.unlink()  # listed, then removed before reading
    labels = torch.cat([y for _, y in loader])
    assert len(labels) == 21  # 18 good, the symlink, and good ones standing in for the two
    assert sorted(os.path.basename(p) for p, _ in loader.stats["skipped"]) == ["dangling.jpg", "vanishes.jpg"]
    assert loader.stats["repeated"] == 2
    loader.close()


class SlowSource(FileSource):
    """A source whose file ``slow`` takes far too long to read (an untrusted, pathological file); the first
    process reading it writes its pid to the file ``note``, where one is given (the loader may read it again
    for the next epoch as this one ends)."""

    def __init__(self, paths, labels, slow, note=None):
        super().__init__(paths, labels)
        object.__setattr__(self, "slow", slow)
        object.__setattr__(self, "note", note)

    def read(self, index):
        if index == self.slow:
            if self.note:
                with contextlib.suppress(FileExistsError), open(self.note, "x") as f:
                    f.write(str(os.getpid()))
            time.sleep(60)
        return super().read(index)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_sample_timeout_replaces_the_worker(tmp_path, policy):
    colours = _mixed_dataset(tmp_path, [])
    paths = sorted(str(p) for p in tmp_path.glob("c*/*.jpg"))
    labels = [int(p.split(os.sep)[-2][1]) for p in paths]
    note = tmp_path / "slow.pid"
    source = SlowSource(paths, labels, slow=4, note=str(note))
    loader = ImageLoader(source, batch_size=6, image_size=16, num_workers=2, device="cpu", on_error=policy,
                         sample_timeout=1.0, drop_last=False, train=False)
    if policy == "raise":
        with pytest.raises(WorkerError, match=r"sample_timeout=1.0s while loading .*good4.jpg"):
            list(loader)
    else:
        out = [(x, y) for x, y in loader]
        got = torch.cat([y for _, y in out])
        assert len(got) == 17 and torch.equal(torch.cat([_colour_labels(x, colours) for x, _ in out]), got)  # left out
        assert loader.stats["skipped_count"] == 1 and "sample_timeout" in loader.stats["skipped"][0][1]
        # the worker that hung was replaced (its read sleeps a minute: the epoch did not wait for it)
        hung = int(note.read_text())
        assert hung not in loader.worker_pids and len(loader.worker_pids) == 2
    loader.close()


def test_a_batch_held_up_by_a_hung_worker_counts_as_late(tmp_path):
    """A chunk the pool settles itself (its worker killed at sample_timeout) finished when it was settled:
    ``last_wait`` (what the CPU share's rule reads) says the batch came about that late, not on time."""
    from gpufeed.augment.params import AugmentSpec
    from gpufeed.workers import PipelineSpec, WorkerPool

    _mixed_dataset(tmp_path, [])
    paths = sorted(str(p) for p in tmp_path.glob("c*/*.jpg"))
    source = SlowSource(paths, [int(p.split(os.sep)[-2][1]) for p in paths], slow=4)
    pool = WorkerPool(PipelineSpec(source, AugmentSpec(image_size=16, resize_size=16, train=False), 10**8,
                                   on_error="skip"), num_workers=2, num_slots=2, batch_size=6, sample_timeout=1.0)
    try:
        pool.submit(0, 0, 0, 0, list(range(6, 12)))  # both workers started and warm
        assert pool.collect(0)[1] == []
        pool.submit(1, 1, 0, 0, list(range(6)))
        _, failures = pool.collect(1)
        assert [f.position for f in failures if "sample_timeout" in f.reason] == [4]
        assert pool.last_wait >= 0.9
    finally:
        pool.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="lists POSIX shared memory in /dev/shm")
def test_a_replacement_worker_that_cannot_start_leaves_the_pool_closable(tmp_path, monkeypatch):
    """Under skip a worker past sample_timeout is replaced; when the replacement cannot start, the error
    comes out of collect, and close() still stops the rest and frees the shared memory."""
    from gpufeed.augment.params import AugmentSpec
    from gpufeed.workers import PipelineSpec, WorkerPool

    _mixed_dataset(tmp_path, [])
    paths = sorted(str(p) for p in tmp_path.glob("c*/*.jpg"))
    source = SlowSource(paths, [int(p.split(os.sep)[-2][1]) for p in paths], slow=2)
    before = shared_memory_mapped()
    pool = WorkerPool(PipelineSpec(source, AugmentSpec(image_size=16, resize_size=16, train=False), 10**8,
                                   on_error="skip"), num_workers=2, num_slots=2, batch_size=4, sample_timeout=1.0)
    pids, made = pool.pids, shared_memory_mapped() - before  # the ring and the file list's block
    assert made

    def cannot_start(self, i):
        raise OSError("pthread_create failed (a stand-in)")

    monkeypatch.setattr(WorkerPool, "_start", cannot_start)
    pool.submit(0, 0, 0, 0, [0, 1, 2, 3])
    with pytest.raises(OSError, match="stand-in"):
        pool.collect(0)
    pool.close()
    assert pool.closed and made & set(os.listdir("/dev/shm")) == set()
    deadline = time.monotonic() + 30  # gone or a zombie soon after close(); slower on a busy machine
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "a worker outlived close()"
        time.sleep(0.1)


class StartsAHelper(FileSource):
    """Reading file ``slow`` forks a helper that outlives the worker (as a library might), writes its pid to
    the file ``note``, then hangs."""

    def __init__(self, paths, labels, slow, note):
        super().__init__(paths, labels)
        object.__setattr__(self, "slow", slow)
        object.__setattr__(self, "note", note)

    def read(self, index):
        if index == self.slow:
            pid = os.fork()
            if pid == 0:  # the helper: every file the worker had open, open here too
                time.sleep(30)
                os._exit(0)
            with open(self.note, "w") as f:
                f.write(str(pid))
            time.sleep(60)
        return super().read(index)


def test_a_killed_worker_is_reported_while_a_process_it_started_lives(tmp_path):
    """The worker dies (SIGKILL, as the out-of-memory killer sends it) while a process it forked lives on,
    holding what the worker held open: still reported within seconds, not when that process ends."""
    from gpufeed.augment.params import AugmentSpec
    from gpufeed.workers import PipelineSpec, WorkerPool

    _mixed_dataset(tmp_path, [])
    paths = sorted(str(p) for p in tmp_path.glob("c*/*.jpg"))
    note = tmp_path / "helper.pid"
    source = StartsAHelper(paths, [int(p.split(os.sep)[-2][1]) for p in paths], slow=2, note=str(note))
    pool = WorkerPool(PipelineSpec(source, AugmentSpec(image_size=16, resize_size=16, train=False), 10**8),
                      num_workers=1, num_slots=2, batch_size=4)
    try:
        pool.submit(0, 0, 0, 0, [0, 1, 2, 3])
        deadline = time.monotonic() + 60  # workers start at a lower priority: slowly on a busy machine
        while not (note.exists() and note.read_text()):
            assert time.monotonic() < deadline, "the source never started its helper"
            time.sleep(0.05)
        os.kill(pool.pids[0], 9)
        with pytest.raises(WorkerError, match=r"exited unexpectedly with code -9 .* while loading .*good2\.jpg"):
            pool.collect(0)
        helper = psutil.Process(int(note.read_text()))  # sleeps 30 s: reported while it lives, not when it ends
        assert helper.is_running() and helper.status() != psutil.STATUS_ZOMBIE
    finally:
        pool.close()
        if note.exists() and note.read_text():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(note.read_text()), 9)


class HangingAfterABadOne(FileSource):
    """File ``bad`` cannot be read; file ``slow``, later in the same chunk, hangs its worker."""

    def __init__(self, paths, labels, bad, slow):
        super().__init__(paths, labels)
        object.__setattr__(self, "bad", bad)
        object.__setattr__(self, "slow", slow)

    def read(self, index):
        if index == self.bad:
            raise OSError("unreadable (a stand-in)")
        if index == self.slow:
            time.sleep(60)
        return super().read(index)


def test_a_failure_before_a_worker_hangs_in_its_chunk_is_not_lost(tmp_path):
    """The worker that holds ``slow`` past the timeout is replaced and its chunk's report dies with it: the
    unreadable file earlier in that chunk must still be skipped, not delivered with stale pixels and label."""
    colours = _mixed_dataset(tmp_path, [])
    paths = sorted(str(p) for p in tmp_path.glob("c*/*.jpg"))
    labels = [int(p.split(os.sep)[-2][1]) for p in paths]
    source = HangingAfterABadOne(paths, labels, bad=1, slow=2)
    with ImageLoader(source, batch_size=6, image_size=16, num_workers=1, device="cpu", on_error="skip",
                     sample_timeout=1.0, drop_last=False, train=False) as loader:
        delivered = []
        for images, got in loader:
            assert torch.equal(_colour_labels(images, colours), got)
            assert [labels[i] for i in loader.batch_indices] == got.tolist()
            delivered += loader.batch_indices
        assert sorted(os.path.basename(p) for p, _ in loader.stats["skipped"]) == sorted(
            os.path.basename(paths[i]) for i in (1, 2))
    assert 1 not in delivered and 2 not in delivered and len(delivered) == 16  # validation: both left out


def test_pixel_cap_rejects_big_images_cleanly(tmp_path):
    from PIL import Image

    (tmp_path / "c").mkdir()
    Image.new("RGB", (3000, 2000), (10, 200, 10)).save(tmp_path / "c" / "big.jpg")
    Image.new("RGB", (60, 40), (10, 200, 10)).save(tmp_path / "c" / "small.jpg")
    with ImageLoader(tmp_path, batch_size=2, image_size=16, num_workers=1, device="cpu", drop_last=False) as loader:
        assert sum(len(y) for _, y in loader) == 2  # a 6 MP photo decodes under the default cap
    with ImageLoader(tmp_path, batch_size=2, image_size=16, num_workers=1, device="cpu", drop_last=False,
                     max_pixels=1_000_000) as loader:
        with pytest.raises(WorkerError, match="big.jpg.*over max_pixels=1000000"):
            list(loader)


@pytest.mark.parametrize("kind", sorted(UNDECODABLE))
def test_broken_files_never_go_to_a_gpu_decoder(kind):
    """GPU decoders fill damage in silently, so broken files must take the strict CPU path."""
    from gpufeed.decode.jpeg_check import gpu_safe_jpeg

    data = UNDECODABLE[kind]()
    if kind == "jpeg_header_bomb":  # sound structure; the pixel cap refuses it from the header first
        with pytest.raises(DecodeError, match="over max_pixels"):
            CpuDecoder().header(data, "bomb.jpg")
    else:
        assert not gpu_safe_jpeg(data)


@pytest.mark.parametrize("start", [b"\xff\xd9", b"\xff\xe0", b"\xff\x00", b"\xd8\xff"])
def test_a_jpeg_whose_start_of_image_marker_is_not_ff_d8_never_goes_to_a_gpu_decoder(start):
    """The check reads the first two bytes as SOI (FF D8), not only a leading FF: a sound baseline JPEG
    whose SOI is overwritten is not a JPEG, so it goes to the strict CPU path, which refuses it."""
    from gpufeed.decode.jpeg_check import gpu_safe_jpeg

    data = DECODABLE["baseline_420"]()
    assert gpu_safe_jpeg(data)
    bad = start + data[2:]
    assert not gpu_safe_jpeg(bad)
    assert CpuDecoder().decode_region(bad, "bad.jpg", (0, 0, 8, 8), 1) is None  # not the cropped decoder
    with pytest.raises(DecodeError, match="bad.jpg"):
        CpuDecoder().decode(bad, "bad.jpg", fast=False)


@pytest.mark.parametrize("kind", ["baseline_420", "cmyk", "grayscale", "restart_markers", "subsampling_444",
                                  "tiny_1x1", "odd_45x29"])
def test_sound_baseline_jpegs_may_go_to_the_gpu(kind):
    from gpufeed.decode.jpeg_check import gpu_safe_jpeg

    assert gpu_safe_jpeg(DECODABLE[kind]())
