"""The GPU stage's logic (who decodes what, fallbacks, the kernel's table, slices) run on the CPU with a
stand-in decoder, fed by a real worker pool's GPU-path output."""


import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed.augment.params import AugmentSpec
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.stage.gpu import GpuDecodeAugment
from gpufeed.decode.base import SkipLog
from gpufeed.ring import KIND_BYTES, KIND_PIXELS, KIND_ROWS, Meta
from gpufeed.records import HostBatch
from gpufeed.sources import folder_source
from gpufeed.workers import PipelineSpec, WorkerPool

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
BUFFER = 1 << 20  # each decode buffer: the whole test batch at once


class CpuStandIn:
    """Decodes like a GPU decoder would (full image, (h, w, 3) uint8), refusing what ``refuse`` names."""

    name = "standin"
    job_images = 48

    def __init__(self, refuse=()):
        self.refuse, self.cpu, self.calls = set(refuse), CpuDecoder(), 0

    def decode(self, job, stream):
        self.calls += 1
        ok = np.zeros(len(job), bool)
        for j in range(len(job)):
            d, out = job.source(j).tobytes(), job.target(j)
            ok[j] = d not in self.refuse
            if ok[j]:
                out.copy_(torch.from_numpy(self.cpu.decode(d, "x", fast=True).copy()))
            else:
                out.fill_(255)  # a refused image's place holds garbage; the stage must overwrite it
        return ok


def host_batch(view, path, release=lambda: None):
    """A finished slot as the scheduler hands it on."""
    n = len(view.labels)
    return HostBatch(torch.from_numpy(view.labels.copy()), view, indices=list(range(n)), consumed=n, release=release,
                     path=path)


def _pool_batch(root, capacity=1 << 20, size=16, cpu_rows=0, **spec_kw):
    src = folder_source(root)
    spec = PipelineSpec(src, AugmentSpec(image_size=size, resize_size=size), 10**8, gpu_bytes_capacity=capacity,
                        gpu_buffer_bytes=BUFFER, **spec_kw)
    pool = WorkerPool(spec, num_workers=2, num_slots=2, batch_size=len(src))
    pool.submit(0, 0, 0, 0, list(range(len(src))), cpu_rows=cpu_rows)
    view, failures = pool.collect(0)
    assert failures == []
    return src, pool, view


def _stage_output(root, decoder, budget=None, cpu_rows=0, job_images=None, size=16, stage_kw=(), **spec_kw):
    src, pool, view = _pool_batch(root, size=size, cpu_rows=cpu_rows, **spec_kw)
    kw = dict(device=torch.device("cpu"), image_size=size, mean=MEAN, std=STD, dtype=torch.float32,
              channels_last=False, max_pixels=10**8, buffer_bytes=budget or BUFFER)
    kw.update(stage_kw)
    stage = GpuDecodeAugment(decoder if isinstance(decoder, list) else [decoder], **kw)
    if job_images:
        stage.job_images = job_images
    images, labels = stage(host_batch(view, src.path))
    stage.kinds = view.meta[:, Meta.KIND].copy()
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
    sliced, labels2, _ = _stage_output(coloured, decoder, budget=24_000)
    assert decoder.calls - calls > 2  # several slices
    assert torch.equal(labels, labels2) and torch.allclose(whole, sliced)


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
    same samples decoded whole by a GPU decoder (a stand-in here) and cropped by the kernel."""
    n = 12
    gpu, labels, stage = _stage_output(textured, CpuStandIn(), size=48)
    assert stage.decoded_by["gpu:standin"] == n
    rows, labels_rows, stage = _stage_output(textured, CpuStandIn(), size=48, cpu_rows=n)
    assert (stage.kinds == KIND_ROWS).all() and stage.decoded_by["cpu"] == n
    assert torch.equal(labels, labels_rows)
    torch.testing.assert_close(rows, gpu, atol=1e-4, rtol=0)


def test_rows_that_do_not_fit_the_pixel_room_are_resized_by_the_worker(textured):
    # at S = 32 a position's room holds 3 x 32 x 32 pixels: the larger crops' rows do not fit
    images, labels, stage = _stage_output(textured, CpuStandIn(), size=32, cpu_rows=12)
    assert set(stage.kinds.tolist()) == {KIND_ROWS, KIND_PIXELS}
    gpu, labels_gpu, _ = _stage_output(textured, CpuStandIn(), size=32)
    assert torch.equal(labels, labels_gpu)
    rows = torch.from_numpy(stage.kinds == KIND_ROWS)
    torch.testing.assert_close(images[rows], gpu[rows], atol=1e-4, rtol=0)
    assert 0 < (images[~rows] - gpu[~rows]).abs().mean() < 0.05


def test_a_uint8_stage_gives_the_crops_pixels_each_the_nearest_level(textured):
    """dtype uint8 (a recipe with pixel ops): the kernel's crops not normalised, each value the nearest level,
    for the JPEGs the GPU decodes and the CPU's share alike, contiguous even where channels_last is asked."""
    exact, labels, _ = _stage_output(textured, CpuStandIn(), size=32, cpu_rows=6,
                                     stage_kw=dict(mean=(0.0,) * 3, std=(1 / 255,) * 3))  # scale 1, shift 0
    pixels, labels8, stage = _stage_output(textured, CpuStandIn(), size=32, cpu_rows=6,
                                           stage_kw=dict(dtype=torch.uint8, channels_last=True))
    assert {KIND_BYTES, KIND_ROWS, KIND_PIXELS} == set(stage.kinds.tolist())
    assert pixels.dtype == torch.uint8 and pixels.shape == (12, 3, 32, 32) and pixels.is_contiguous()
    assert torch.equal(labels, labels8)
    diff = pixels.float() - exact
    assert diff.abs().max() <= 0.5 + 1e-4
    assert (diff > 0.1).sum() > 100  # rounded up where the nearest level is above (a cast would truncate)


def test_stage_with_a_cpu_share_keeps_labels_aligned(coloured):
    refuse = {open(p, "rb").read() for p in sorted(coloured.glob("c2/*.jpg"))[-1:]}
    images, labels, stage = _stage_output(coloured, CpuStandIn(refuse), cpu_rows=6)
    assert torch.equal(_colour_index(images), labels)
    # 6 rows by the workers, the PNG (if not among them) and the refused JPEG after the GPU
    assert stage.decoded_by["cpu"] in (7, 8) and stage.decoded_by["cpu"] + stage.decoded_by["gpu:standin"] == 13


def test_stage_start_finish_releases_the_batch_once_after_its_decode(coloured):
    """The stage holds the slot from start to finish; finish releases it exactly once, also when the
    batch fails, and start + finish gives what one call gives."""
    src, pool, view = _pool_batch(coloured)
    released = []
    decoder = CpuStandIn()
    stage = GpuDecodeAugment([decoder], device=torch.device("cpu"), image_size=16, mean=MEAN, std=STD,
                             dtype=torch.float32, channels_last=False, max_pixels=10**8, buffer_bytes=BUFFER)

    def batch():
        return host_batch(view, src.path, release=lambda: released.append(decoder.calls))

    whole, labels = stage(batch())
    assert released == [1]
    started = stage.start(batch())
    assert released == [1]  # held until finish
    out, labels2 = stage.finish(started)
    assert released == [1, 2] and torch.equal(out, whole) and torch.equal(labels, labels2)
    decoder.decode = lambda *a: (_ for _ in ()).throw(RuntimeError("decoder died"))
    started = stage.start(batch())
    with pytest.raises(RuntimeError, match="decoder died"):
        stage.finish(started)
    assert released == [1, 2, 2]
    stage._submit_decode = lambda *a: (_ for _ in ()).throw(MemoryError("no room"))
    with pytest.raises(MemoryError, match="no room"):
        stage.start(batch())  # a start that fails hands the batch back itself: no finish follows
    assert released == [1, 2, 2, 2]
    pool.close()


def test_the_slot_goes_back_before_the_last_kernel_once_every_slice_is_read(coloured):
    """A batch in slices: the slot is released once, after the last slice's decode and copies and before its
    kernel (whose output batch may wait for the training), so the workers can refill it sooner."""
    src, pool, view = _pool_batch(coloured, cpu_rows=4)
    decoder = CpuStandIn()
    stage = GpuDecodeAugment([decoder], device=torch.device("cpu"), image_size=16, mean=MEAN, std=STD,
                             dtype=torch.float32, channels_last=False, max_pixels=10**8, buffer_bytes=24_000)
    events, kernel = [], stage._device.kernel
    stage._device.kernel = lambda *a: (events.append("kernel"), kernel(*a))[1]
    images, labels = stage(host_batch(view, src.path, release=lambda: events.append(f"release {decoder.calls}")))
    slices = decoder.calls
    assert slices > 2 and events == ["kernel"] * (slices - 1) + [f"release {slices}", "kernel"]
    assert torch.equal(_colour_index(images), labels)
    pool.close()


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_file_no_decoder_reads_gets_a_stand_in_in_place(coloured, channels_last):
    """Refused by the GPU decoder and broken for the CPU fallback, under skip: a good image of the batch
    stands in, in place (the batch keeps its size and memory format), with its label and index."""
    src, pool, view = _pool_batch(coloured)
    bad = int(np.flatnonzero(view.meta[:, Meta.KIND] == KIND_BYTES)[2])
    length = int(view.meta[bad, Meta.LENGTH])
    view.arena[bad, 200:length] = 0  # corrupt entropy data: libjpeg-turbo refuses it
    skips = SkipLog()
    stage = GpuDecodeAugment([CpuStandIn({view.arena[bad, :length].tobytes()})], device=torch.device("cpu"),
                             image_size=16, mean=MEAN, std=STD, dtype=torch.float32, channels_last=channels_last,
                             max_pixels=10**8, buffer_bytes=BUFFER, skips=skips)
    batch = host_batch(view, src.path)
    images, labels = stage(batch)
    pool.close()
    assert images.shape[0] == labels.shape[0] == len(src) and skips.total == skips.repeated == 1
    assert images.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    sub = batch.indices[bad]
    assert sub != bad and torch.equal(images[bad], images[sub]) and labels[bad] == labels[sub]
    assert torch.equal(_colour_index(images), labels)


def test_output_batches_are_reused_once_dropped_and_never_while_held(coloured):
    """The stage's output memory stays what is in flight: a batch nothing refers to is written again, one the
    user still holds (or holds a view of) never is."""
    src, pool, view = _pool_batch(coloured)
    stage = GpuDecodeAugment([CpuStandIn()], device=torch.device("cpu"), image_size=16, mean=MEAN, std=STD,
                             dtype=torch.float32, channels_last=False, max_pixels=10**8, buffer_bytes=BUFFER)
    first, _ = stage(host_batch(view, src.path))
    expected = first.clone()
    part = first[:2]  # a view holds the memory as the tensor does
    first_ptr = first.data_ptr()
    del first
    second, _ = stage(host_batch(view, src.path))
    assert second.data_ptr() != first_ptr
    second.zero_()
    assert torch.equal(part, expected[:2])  # not written by the second batch
    del part
    third, _ = stage(host_batch(view, src.path))
    assert third.data_ptr() == first_ptr and torch.equal(third, expected)  # reused, and fully rewritten
    fourth, _ = stage(host_batch(view, src.path))
    assert fourth.data_ptr() != first_ptr and torch.equal(second, torch.zeros_like(second))  # both held: untouched
    del second
    fifth, _ = stage(host_batch(view, src.path))
    assert fifth.data_ptr() != fourth.data_ptr() and torch.equal(fifth, expected)
    pool.close()


def test_planned_output_batches_serve_every_batch_also_a_short_last_one(coloured):
    """Output batches planned at construction (``output_batches``) are all the memory batches take while the
    user keeps none: the first batch makes them, later ones reuse them, a shorter last batch gets a view."""
    src, pool, view = _pool_batch(coloured)
    n = len(src)
    stage = GpuDecodeAugment([CpuStandIn()], device=torch.device("cpu"), image_size=16, mean=MEAN, std=STD,
                             dtype=torch.float32, channels_last=True, max_pixels=10**8, buffer_bytes=BUFFER,
                             output_batches=(n, 2))
    first, _ = stage(host_batch(view, src.path))
    planned = {t.data_ptr() for t in stage.held_outputs}
    assert len(planned) == 2 and first.data_ptr() in planned
    ptrs = [first.data_ptr()]
    del first
    for _ in range(3):
        out, _ = stage(host_batch(view, src.path))
        ptrs.append(out.data_ptr())
        del out
    short, _ = stage(host_batch(view.head(n - 3), lambda i: src.path(i)))
    assert len(short) == n - 3 and short.is_contiguous(memory_format=torch.channels_last)
    assert set(ptrs) | {short.data_ptr()} <= planned and len(stage.held_outputs) == 2
    pool.close()


def test_decode_calls_never_hold_more_images_than_the_decoders_took_memory_for(coloured):
    """nvJPEG's decoders take their memory for calls of ``job_images`` at most (placement.decode_call_images):
    the stage never gives one more, however the batch is dealt."""
    calls = []

    class Recording(CpuStandIn):
        job_images = 5

        def decode(self, job, stream):
            calls.append(len(job))
            return super().decode(job, stream)

    images, labels, stage = _stage_output(coloured, [Recording(), Recording()], job_images=5)
    encoded = int(sum(1 for k in stage.kinds if k == KIND_BYTES))
    assert encoded > 10 and max(calls) <= 5 and sum(calls) == encoded and len(calls) >= 3


def test_batched_copy_refuses_arrays_of_different_lengths():
    """A destination or source missing for a size would have the driver read past an array's end."""
    from gpufeed.batched_copy import BatchedCopy

    with pytest.raises(ValueError, match="2 destinations and 3 sources for 2 sizes"):
        BatchedCopy().copy(np.zeros(2, np.uint64), np.zeros(3, np.uint64), np.ones(2, np.uint64), None)
