"""The scheduler: batches cut from the sampler's order in order, ring slots reused only once released, the
next epoch's first batches started early and adopted only by that epoch from its start."""

import functools

import pytest
import torch

from gpufeed.augment.params import AugmentSpec
from gpufeed.decode.base import SkipLog
from gpufeed.placement import ShareControl
from gpufeed.sampling import ShardedSampler
from gpufeed.schedule import Scheduler
from gpufeed.sources import folder_source
from gpufeed.workers import PipelineSpec, WorkerPool


def make_scheduler(src):
    spec = PipelineSpec(src, AugmentSpec(image_size=16, resize_size=16), 10**8)
    return Scheduler(start_pool=functools.partial(WorkerPool, spec, num_workers=2, num_slots=4, batch_size=8),
                     num_slots=4, batch_size=8, drop_last=True, share=ShareControl(1.0), skips=SkipLog(),
                     path=src.path, cuda=False)


@pytest.fixture()
def parts(synth_root):
    src = folder_source(synth_root)
    scheduler = make_scheduler(src)
    yield src, scheduler, ShardedSampler(len(src), seed=4)
    scheduler.close()


def _run(scheduler, sampler, keep=()):
    """An epoch's batches: (labels, pixels copied at once, consumed); batch numbers in ``keep`` are not
    released (their slots stay out), the others are as soon as they are read."""
    out, held = [], []
    for k, batch in enumerate(scheduler.batches(sampler)):
        out.append((batch.labels.clone(), batch.images.clone(), batch.consumed, batch))
        (held.append if k in keep else lambda b: b.release())(batch)
    return out, held


def test_batches_follow_the_order_and_count_what_they_took(parts):
    src, scheduler, sampler = parts
    got, _ = _run(scheduler, sampler)
    order = sampler.epoch_indices()
    assert len(got) == 5 and [c for _, _, c, _ in got] == [8] * 5
    assert torch.cat([labels for labels, *_ in got]).tolist() == [src.label(i) for i in order]


def test_a_slot_is_not_written_again_before_it_is_released(parts):
    _, scheduler, sampler = parts
    got, held = _run(scheduler, sampler, keep={0})
    first = got[0]
    assert len(got) == 5 and len(held) == 1
    assert torch.equal(first[3].images, first[1])  # the held slot still holds batch 0's pixels
    # the others reused the three remaining slots in turn
    assert len({b.images.data_ptr() for *_, b in got}) == 4


def test_the_next_epoch_starts_early_and_is_adopted_only_from_its_start(parts):
    src, scheduler, sampler = parts
    _run(scheduler, sampler)
    assert scheduler.ahead is not None and scheduler.ahead.epoch == 1 and scheduler.ahead.inflight
    sampler.set_epoch(1)
    adopted, _ = _run(scheduler, sampler)
    assert scheduler.ahead is not None and scheduler.ahead.epoch == 2
    sampler.set_epoch(5)  # another epoch: the early start is cancelled
    other, _ = _run(scheduler, sampler)
    fresh = make_scheduler(src)
    try:
        for epoch, got in ((1, adopted), (5, other)):
            want, _ = _run(fresh, ShardedSampler(sampler.num_samples_total, seed=4, epoch=epoch))
            assert len(got) == len(want) == 5
            for (la, xa, *_), (lb, xb, *_) in zip(got, want):
                assert torch.equal(la, lb) and torch.equal(xa, xb)
    finally:
        fresh.close()


@pytest.mark.parametrize("stand_ins", [True, False])
def test_skipped_samples_anywhere_in_a_batch_leave_labels_pixels_and_indices_together(tmp_path, stand_ins):
    """Bad files first, in the middle and last of their batches (and a whole batch of them): whether a good
    sample of the batch stands in (training) or the bad ones leave it (validation), every delivered sample's
    label, pixels and index are one sample's: its label, the pixels a worker makes of that index alone."""
    import numpy as np

    from gpufeed.decode.cpu import CpuDecoder
    from gpufeed.workers.chunks import load_sample_into
    from tests.helpers import textured

    tints = [(220, 30, 30), (30, 220, 30), (30, 30, 220), (220, 220, 30)]
    for c, tint in enumerate(tints):
        (tmp_path / f"c{c}").mkdir()
        for i in range(8):
            textured(40 + 3 * i, 36, 10 * c + i, tint).save(tmp_path / f"c{c}" / f"{i}.jpg", quality=90)
    src = folder_source(tmp_path)
    sampler = ShardedSampler(len(src), seed=7)
    order = sampler.epoch_indices()
    bad = {order[p] for p in (0, 3, 7, 9, 14)} | set(order[16:24])  # batch 2: all of it
    for i in bad:
        with open(src.path(i), "wb") as f:
            f.write(b"\xff\xd8\xff\xe0 not a jpeg")
    spec = PipelineSpec(src, AugmentSpec(train=False, image_size=16, resize_size=18), 10**8, on_error="skip")
    skips = SkipLog()
    scheduler = Scheduler(start_pool=functools.partial(WorkerPool, spec, num_workers=2, num_slots=4, batch_size=8),
                          num_slots=4, batch_size=8, drop_last=False, share=ShareControl(1.0), skips=skips,
                          path=src.path, cuda=False, stand_ins=stand_ins)
    decoder, one = CpuDecoder(max_pixels=10**8), np.empty((16, 16, 3), np.uint8)
    delivered, batches = [], []
    try:
        for batch in scheduler.batches(sampler):
            assert len(batch.indices) == len(batch.labels) == len(batch.images)
            for k, index in enumerate(batch.indices):
                assert index not in bad
                assert batch.labels[k].item() == src.label(index), (k, index)
                load_sample_into(spec, decoder, sampler.seed, sampler.epoch, index, one)
                assert np.array_equal(batch.images[k].numpy(), one), (k, index)
            delivered += batch.indices
            batches.append(batch.indices)
            batch.release()
    finally:
        scheduler.close()
    good = [i for i in order if i not in bad]
    if stand_ins:  # every batch full, each entry of the order in it or a good sample of its batch in its place
        assert len(delivered) == 32 and set(delivered) == set(good)
        assert batches[2] == order[24:32]  # the batch none of which loaded: the next entries of the order
    else:
        assert delivered == good
    assert len(skips.listed) == len(bad)


def test_a_stand_in_on_the_gpu_path_carries_what_holds_its_image(tmp_path):
    """Training on the GPU path under on_error="skip", half of each batch decoded to rows by the CPU: a good
    sample standing in for a bad one takes along its meta row and label and, by its kind, its JPEG's bytes, its
    decoded rows or its pixels, so both places hold the same image; a JPEG left for the GPU is its file."""
    import numpy as np

    from gpufeed.ring import KIND_BYTES, KIND_PIXELS, KIND_ROWS, Meta
    from tests.helpers import textured

    for c in range(2):
        (tmp_path / f"c{c}").mkdir()
        for i in range(8):
            textured(90 + 11 * i, 80 + 9 * c, 10 * c + i).save(tmp_path / f"c{c}" / f"{i}.jpg", quality=90)
    src = folder_source(tmp_path)
    bad = {1, 6, 9, 14}
    for i in bad:
        with open(src.path(i), "wb") as f:
            f.write(b"\xff\xd8\xff\xe0 not a jpeg")
    spec = PipelineSpec(src, AugmentSpec(image_size=32), 10**8, gpu_bytes_capacity=1 << 20,
                        gpu_buffer_bytes=1 << 22, on_error="skip")
    scheduler = Scheduler(start_pool=functools.partial(WorkerPool, spec, num_workers=2, num_slots=3, batch_size=8),
                          num_slots=3, batch_size=8, drop_last=False, share=ShareControl(0.5), skips=SkipLog(),
                          path=src.path, cuda=False)
    kinds, moved = set(), set()  # the kinds delivered, and those a stand-in took along
    try:
        for batch in scheduler.batches(ShardedSampler(len(src), shuffle=False)):
            slot = batch.slot
            first = {}  # index -> its first position
            for k, index in enumerate(batch.indices):
                assert index not in bad and batch.labels[k].item() == src.label(index)
                kind, length = slot.meta[k, Meta.KIND], slot.meta[k, Meta.LENGTH]
                kinds.add(int(kind))
                if kind == KIND_BYTES:
                    assert slot.arena[k, :length].tobytes() == open(src.path(index), "rb").read(), (k, index)
                g = first.setdefault(index, k)
                if g == k:
                    continue
                assert np.array_equal(slot.meta[k], slot.meta[g])
                moved.add(int(kind))
                if kind == KIND_ROWS:
                    assert np.array_equal(slot.rooms[k, :length], slot.rooms[g, :length]), (k, g)
                elif kind == KIND_PIXELS:
                    assert np.array_equal(slot.images[k], slot.images[g]), (k, g)
            assert len(first) < len(batch.indices)  # a stand-in in every batch
            batch.release()
    finally:
        scheduler.close()
    assert {KIND_BYTES, KIND_ROWS} <= moved <= kinds
