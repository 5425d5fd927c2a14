"""The GPU stage's logic (who decodes what, fallbacks, kernel rows, slices) run on the CPU with a
stand-in decoder, and the workers' GPU-path output (bytes + boxes in the ring)."""


import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed.augment.params import AugmentSpec, CropBox
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.gpu_stage import EncodedBatch, GpuDecodeAugment
from gpufeed.sources import folder_source
from gpufeed.ring import KIND_BYTES, KIND_PIXELS, KIND_ROWS
from gpufeed.loader import _ShareControl
from gpufeed.workers import PipelineSpec, WorkerError, WorkerPool, _Inspected, cheapest_on_cpu, inspect_sample

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class CpuStandIn:
    """Decodes like a GPU decoder would (full image, (h, w, 3) uint8), refusing what ``refuse`` names."""

    name = "standin"

    def __init__(self, refuse=()):
        self.refuse, self.cpu, self.calls = set(refuse), CpuDecoder(), 0

    def decode_into(self, datas, outs, stream):
        self.calls += 1
        ok = []
        for d, out in zip(datas, outs):
            d = d.tobytes()
            ok.append(d not in self.refuse)
            if ok[-1]:
                out.copy_(torch.from_numpy(self.cpu.decode(d, "x", fast=True).copy()))
            else:
                out.fill_(255)  # a refused image's place holds garbage; the stage must overwrite it
        return ok


@pytest.fixture()
def coloured(tmp_path):
    colours = [(220, 30, 30), (30, 220, 30), (30, 30, 220)]
    for c, colour in enumerate(colours):
        (tmp_path / f"c{c}").mkdir()
        for i in range(4):
            Image.new("RGB", (60 + 10 * i, 50), colour).save(tmp_path / f"c{c}" / f"{i}.jpg", quality=95)
    Image.new("RGB", (40, 40), colours[1]).save(tmp_path / "c1" / "png.jpg", "PNG")
    return tmp_path


def _pool_batch(root, capacity=1 << 20, size=16, cpu_rows=0, **spec_kw):
    src = folder_source(root)
    spec = PipelineSpec(src, AugmentSpec(image_size=size, resize_size=size), 10**8, gpu_bytes_capacity=capacity,
                        **spec_kw)
    pool = WorkerPool(spec, num_workers=2, num_slots=2, batch_size=len(src))
    pool.submit(0, 0, 0, 0, list(range(len(src))), cpu_rows=cpu_rows)
    view, failures = pool.collect(0)
    assert failures == []
    return src, pool, view


def test_workers_leave_jpegs_encoded_and_finish_odd_files(coloured):
    src, pool, view = _pool_batch(coloured)
    kinds = view.meta[:, 0].tolist()
    png = [i for i in range(len(src)) if src.path(i).endswith("png.jpg")][0]
    assert kinds[png] == KIND_PIXELS and kinds.count(KIND_BYTES) == len(src) - 1
    for i in range(len(src)):
        if kinds[i] == KIND_BYTES:
            assert view.arena[i, : view.meta[i, 1]].tobytes() == src.read(i)
            w, h = Image.open(src.path(i)).size
            assert tuple(view.meta[i, 2:4]) == (w, h)
    assert view.images[png].mean() > 0  # cropped by the worker
    pool.close()


def test_files_over_the_capacity_are_decoded_by_the_workers(coloured):
    src, pool, view = _pool_batch(coloured, capacity=100)
    assert (view.meta[:, 0] == KIND_PIXELS).all()
    pool.close()


def _stage_output(root, decoder, budget=None, cpu_rows=0, job_images=None, size=16, **spec_kw):
    src, pool, view = _pool_batch(root, size=size, cpu_rows=cpu_rows, **spec_kw)
    kw = dict(device=torch.device("cpu"), image_size=size, mean=MEAN, std=STD, dtype=torch.float32,
              channels_last=False, max_pixels=10**8)
    if budget:
        kw["max_batch_pixels"] = budget
    stage = GpuDecodeAugment(decoder if isinstance(decoder, list) else [decoder], **kw)
    if job_images:
        stage.job_images = job_images
    batch = EncodedBatch(torch.from_numpy(view.labels.copy()), view.meta, view.arena, view.images,
                         lambda i: src.path(i), rooms=view.rooms)
    images, labels = stage(batch)
    stage.kinds = view.meta[:, 0].copy()
    pool.close()
    return images, labels, stage


def _colour_index(images):
    m, s = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return ((images * s + m) * 255).mean(dim=(2, 3)).argmax(dim=1)


def test_stage_labels_stay_aligned_with_gpu_refusals_and_cpu_rows(coloured):
    refuse = {open(p, "rb").read() for p in sorted(coloured.glob("c2/*.jpg"))[:2]}
    images, labels, stage = _stage_output(coloured, CpuStandIn(refuse))
    assert images.shape == (13, 3, 16, 16) and not torch.isnan(images).any()
    assert torch.equal(_colour_index(images), labels)
    assert stage.decoded_by["cpu"] == 3 and stage.decoded_by["gpu:standin"] == 10


def test_calls_of_a_few_images_dealt_to_several_decoders_keep_labels_aligned(coloured):
    refuse = {open(p, "rb").read() for p in sorted(coloured.glob("c0/*.jpg"))[1:3]}
    decoders = [CpuStandIn(refuse), CpuStandIn(refuse)]
    images, labels, stage = _stage_output(coloured, decoders, job_images=2)
    assert torch.equal(_colour_index(images), labels)
    assert decoders[0].calls == 3 and decoders[1].calls == 3  # 12 JPEGs in 6 calls of 2, taken in turn
    assert stage.decoded_by["cpu"] == 3 and stage.decoded_by["gpu:standin"] == 10


def test_stage_splits_batches_over_the_pixel_budget(coloured):
    decoder = CpuStandIn()
    whole, labels, _ = _stage_output(coloured, decoder)
    calls = decoder.calls
    sliced, labels2, _ = _stage_output(coloured, decoder, budget=8000)
    assert decoder.calls - calls > 2  # several slices
    assert torch.equal(labels, labels2) and torch.allclose(whole, sliced)


def test_the_cpu_share_goes_to_the_cheapest_samples_of_each_chunk(coloured):
    src, pool, view = _pool_batch(coloured, cpu_rows=5)
    n, chunk = len(src), pool._chunk
    on_cpu = set(np.flatnonzero(view.meta[:, 0] != KIND_BYTES).tolist())
    expected = set()
    for a in range(0, n, chunk):  # 5 rows spread over the chunks; in each, the PNG first, then the cheapest
        b = min(a + chunk, n)
        quota = round(5 * b / n) - round(5 * a / n)
        seen = [inspect_sample(pool._spec, CpuDecoder(), 0, 0, i) for i in range(a, b)]
        forced = {a + j for j, s in enumerate(seen) if not s.gpu_ok}
        costs = sorted((s.cpu_cost() / s.engine_cost(), a + j) for j, s in enumerate(seen) if s.gpu_ok)
        expected |= forced | {i for _, i in costs[: max(0, quota - len(forced))]}
    png = [i for i in range(n) if src.path(i).endswith("png.jpg")][0]
    assert on_cpu == expected and png in on_cpu and len(on_cpu) in (5, 6)  # 6: the PNG's chunk had no quota
    for i in on_cpu:  # decoded: cropped and resized (pixels), or the crop's rows left for the GPU
        kind, length = view.meta[i, :2]
        assert (view.images[i].max() if kind == KIND_PIXELS else view.rooms[i, :length].max()) > 0
    pool.close()


@pytest.fixture()
def textured(tmp_path):
    rng = np.random.default_rng(0)
    for c in range(2):
        (tmp_path / f"c{c}").mkdir()
        for i in range(6):
            h, w = 60 + 7 * i, 90 - 5 * i
            yy, xx = np.mgrid[0:h, 0:w]
            img = np.stack([xx * 255 // w, yy * 255 // h, rng.integers(0, 256, (h, w))], -1).astype(np.uint8)
            Image.fromarray(img).save(tmp_path / f"c{c}" / f"{i}.jpg", quality=90)
    return tmp_path


def test_the_cpu_shares_rows_give_the_kernel_the_pixels_of_a_gpu_decode(textured):
    """The CPU's share leaves its crops' decoded rows for the kernel (KIND_ROWS): the output equals the
    same samples decoded whole by a GPU decoder (a stand-in here) and cropped by the kernel. Resized on
    the CPU instead (``rows_to_gpu=False``), it is close, not equal (another filter)."""
    n = 12
    gpu, labels, stage = _stage_output(textured, CpuStandIn(), size=48)
    assert stage.decoded_by["gpu:standin"] == n
    rows, labels_rows, stage = _stage_output(textured, CpuStandIn(), size=48, cpu_rows=n)
    assert (stage.kinds == KIND_ROWS).all() and stage.decoded_by["cpu"] == n
    assert torch.equal(labels, labels_rows)
    torch.testing.assert_close(rows, gpu, atol=1e-4, rtol=0)
    resized, _, stage = _stage_output(textured, CpuStandIn(), size=48, cpu_rows=n, rows_to_gpu=False)
    assert (stage.kinds == KIND_PIXELS).all()
    err = (resized - gpu).abs()
    assert 0 < err.mean() < 0.05, err.mean()


def test_rows_that_do_not_fit_the_pixel_room_are_resized_by_the_worker(textured):
    # at S = 32 a position's room holds 3 x 32 x 32 pixels: the larger crops' rows do not fit
    images, labels, stage = _stage_output(textured, CpuStandIn(), size=32, cpu_rows=12)
    assert set(stage.kinds.tolist()) == {KIND_ROWS, KIND_PIXELS}
    gpu, labels_gpu, _ = _stage_output(textured, CpuStandIn(), size=32)
    assert torch.equal(labels, labels_gpu)
    rows = torch.from_numpy(stage.kinds == KIND_ROWS)
    torch.testing.assert_close(images[rows], gpu[rows], atol=1e-4, rtol=0)
    assert 0 < (images[~rows] - gpu[~rows]).abs().mean() < 0.05


def test_the_cpu_takes_small_boxes_near_the_top_first():
    def sample(y, h, w=100):
        return _Inspected(0, "x.jpg", bytes(1000), (100, 100, True), 1, True, CropBox(0, y, w, h))

    # costs: 1000 bytes x (y + h) / 100 rows + half the box's pixels
    chunk = {10: sample(50, 50), 11: sample(0, 20, 20), 12: sample(0, 100), 13: sample(10, 30, 30)}
    assert [round(s.cpu_cost()) for s in chunk.values()] == [3500, 400, 6000, 850]
    assert cheapest_on_cpu(chunk, 0) == cheapest_on_cpu(chunk, -1) == set()
    assert cheapest_on_cpu(chunk, 2) == {11, 13}
    assert cheapest_on_cpu(chunk, 9) == {10, 11, 12, 13}
    # same-sized files: dividing by the engines' cost (bytes + 36,000) keeps the order
    assert cheapest_on_cpu(chunk, 2, "cpu_cost") == {11, 13}


def test_the_cpu_takes_what_saves_the_engines_most_per_unit_of_its_own_cost():
    def sample(nbytes, y, h, w):
        return _Inspected(0, "x.jpg", bytes(nbytes), (100, 100, True), 1, True, CropBox(0, y, w, h))

    # a: a large file with a small box at the top: CPU 100,000 x 20 / 100 + 200 = 20,200, engines 136,000
    # b: a small file cropped whole:               CPU 4,000 + 5,000 = 9,000,              engines 40,000
    chunk = {0: sample(100_000, 0, 20, 20), 1: sample(4_000, 0, 100, 100)}
    assert [round(s.cpu_cost()) for s in chunk.values()] == [20_200, 9_000]
    assert [s.engine_cost() for s in chunk.values()] == [136_000, 40_000]
    assert cheapest_on_cpu(chunk, 1) == {0}  # 0.149 < 0.225
    assert cheapest_on_cpu(chunk, 1, "cpu_cost") == {1}
    with pytest.raises(ValueError, match="cpu_pick must be one of"):
        cheapest_on_cpu(chunk, 1, "bytes")


def test_stage_with_a_cpu_share_keeps_labels_aligned(coloured):
    refuse = {open(p, "rb").read() for p in sorted(coloured.glob("c2/*.jpg"))[-1:]}
    images, labels, stage = _stage_output(coloured, CpuStandIn(refuse), cpu_rows=6)
    assert torch.equal(_colour_index(images), labels)
    # 6 rows by the workers, the PNG (if not among them) and the refused JPEG after the GPU
    assert stage.decoded_by["cpu"] in (7, 8) and stage.decoded_by["cpu"] + stage.decoded_by["gpu:standin"] == 13


class _ScriptedIdle:
    """Idle-core readings on demand: ``poll`` returns the next queued value, None when none is queued."""

    def __init__(self, cores=16):
        self.capacity, self.readings = float(cores), []

    def poll(self):
        return self.readings.pop(0) if self.readings else None


def test_share_control_gives_the_workers_what_they_keep_up_with_and_leaves_cores_idle():
    idle = _ScriptedIdle(16)
    auto = _ShareControl("auto", idle)
    start, step = auto.value, 1 / 32
    assert auto.reserve == 4  # a quarter of the cores
    for _ in range(5):
        auto.update(collect_wait=0.0)  # ready, but the window has not ended: no change
    assert auto.value == start
    idle.readings = [8.0, 8.0, 4.5]
    for _ in range(3):
        auto.update(0.0)  # two windows with cores to spare: more; 4.5 idle is within the margin: hold
    assert auto.value == pytest.approx(start + 2 * step)
    for wait in (0.02, 0.02):
        auto.update(wait)  # two of the window's three batches were late: less, whatever the load
    idle.readings = [8.0]
    auto.update(0.0)
    assert auto.value == pytest.approx(start + step)
    for wait in (0.02, 0.0, 0.0):
        auto.update(wait)  # one late batch of four: not most
    idle.readings = [8.0]
    auto.update(0.0)
    assert auto.value == pytest.approx(start + 2 * step)
    idle.readings = [3.7]
    auto.update(0.0)  # fewer than 4 cores idle: less, a step per core missing (at least one)
    assert auto.value == pytest.approx(start + step)
    idle.readings = [1.0, 12.0]
    auto.update(0.0)
    assert auto.value == pytest.approx(start - 2 * step)
    auto.update(0.0)  # up: one step a window however many cores idle
    assert auto.value == pytest.approx(start - step)
    idle.readings = [0.0]
    auto.update(0.0)  # 4 missing: 4 steps, the most a window
    assert auto.value == pytest.approx(start - 5 * step)
    idle.readings = [16.0] * 100
    for _ in range(100):
        auto.update(0.0)
    assert auto.value == 1.0
    idle.readings = [16.0] * 100
    for _ in range(100):
        auto.update(0.5)
    assert auto.value == 0.0
    fixed = _ShareControl(0.3)
    fixed.update(0.0)
    assert fixed.value == 0.3


def test_the_structural_check_keeps_progressive_jpegs_off_the_gpu_unless_switched_off(tmp_path):
    (tmp_path / "a").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), np.uint8)).save(
        tmp_path / "a" / "p.jpg", quality=90, progressive=True)
    src = folder_source(tmp_path)
    kinds = {}
    for check in (True, False):
        spec = PipelineSpec(src, AugmentSpec(image_size=16, resize_size=16), 10**8, gpu_bytes_capacity=1 << 20,
                            check_structure=check)
        pool = WorkerPool(spec, num_workers=1, num_slots=1, batch_size=1)
        pool.submit(0, 0, 0, 0, [0])
        view, failures = pool.collect(0)
        assert failures == []
        kinds[check] = int(view.meta[0, 0])
        pool.close()
    assert kinds == {True: KIND_PIXELS, False: KIND_BYTES}


def test_stage_start_finish_releases_the_batch_once_after_its_decode(coloured):
    """The stage holds the slot from start to finish; finish releases it exactly once, also when the
    batch fails, and start + finish gives what one call gives."""
    src, pool, view = _pool_batch(coloured)
    released = []
    decoder = CpuStandIn()
    stage = GpuDecodeAugment([decoder], device=torch.device("cpu"), image_size=16, mean=MEAN, std=STD,
                             dtype=torch.float32, channels_last=False, max_pixels=10**8)

    def batch():
        return EncodedBatch(torch.from_numpy(view.labels.copy()), view.meta, view.arena, view.images, src.path,
                            release=lambda: released.append(decoder.calls))

    whole, labels = stage(batch())
    assert released == [1]
    started = stage.start(batch())
    assert released == [1]  # held until finish
    out, labels2 = stage.finish(started)
    assert released == [1, 2] and torch.equal(out, whole) and torch.equal(labels, labels2)
    decoder.decode_into = lambda *a: (_ for _ in ()).throw(RuntimeError("decoder died"))
    started = stage.start(batch())
    with pytest.raises(RuntimeError, match="decoder died"):
        stage.finish(started)
    assert released == [1, 2, 2]
    stage._submit_decode = lambda *a: (_ for _ in ()).throw(MemoryError("no room"))
    with pytest.raises(MemoryError, match="no room"):
        stage.start(batch())  # a start that fails hands the batch back itself: no finish follows
    assert released == [1, 2, 2, 2]
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
        spec = PipelineSpec(src, AugmentSpec(image_size=16, resize_size=16), 10**8, gpu_bytes_capacity=1 << 20,
                            on_error=policy)
        pool = WorkerPool(spec, num_workers=2, num_slots=1, batch_size=len(src))
        pool.submit(0, 0, 0, 0, list(range(len(src))), cpu_rows=cpu_rows)
        if policy == "raise":
            with pytest.raises(WorkerError, match="c1/2.jpg"):
                pool.collect(0)
        else:
            view, failures = pool.collect(0)
            assert [(f.position, f.path) for f in failures] == [(bad, src.path(bad))]
            good = [i for i in range(len(src)) if i != bad]
            assert view.labels[good].tolist() == [src.label(i) for i in good]
            kinds = view.meta[good, 0]
            assert set(kinds.tolist()) <= {KIND_BYTES, KIND_PIXELS, KIND_ROWS}
            # the PNG is always decoded here and counts in its chunk's quota; the broken file takes none of it
            assert (kinds != KIND_BYTES).sum() == max(1, cpu_rows)
        pool.close()
