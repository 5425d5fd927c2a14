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
