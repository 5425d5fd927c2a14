import dataclasses
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpufeed import prefetch

Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    meta: str


def test_cpu_pass_through_keeps_structure_and_len():
    data = [{"a": torch.ones(2), "b": [torch.zeros(1), (torch.arange(3), "tag")]}, Pair(torch.ones(1), 5),
            Batch(torch.full((2,), 3.0), "m")]
    out = list(prefetch(data, "cpu"))
    assert out[0]["b"][1][1] == "tag" and torch.equal(out[0]["b"][1][0], torch.arange(3))
    assert isinstance(out[1], Pair) and out[1].y == 5
    assert isinstance(out[2], Batch) and out[2].meta == "m" and out[2].x.tolist() == [3.0, 3.0]
    assert len(prefetch(data, "cpu")) == 3


def test_wraps_a_dataloader_and_applies_transform():
    dl = DataLoader(TensorDataset(torch.arange(10.0), torch.arange(10)), batch_size=4)
    out = list(prefetch(dl, "cpu", transform=lambda b: (b[0] * 2, b[1])))
    assert len(out) == 3 and out[0][0].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_exception_surfaces_with_original_traceback():
    def gen():
        yield torch.ones(1)
        raise KeyError("broken sample 17")

    it = iter(prefetch(gen(), "cpu"))
    next(it)
    with pytest.raises(KeyError, match="broken sample 17") as info:
        next(it)
    assert any(f.name == "gen" for f in info.traceback)


def test_early_break_closes_the_source():
    closed = []

    def gen():
        try:
            for i in range(100):
                yield torch.tensor([i])
        finally:
            closed.append(True)

    for i, _ in enumerate(prefetch(gen(), "cpu")):
        if i == 2:
            break
    import gc
    gc.collect()
    assert closed == [True]


def test_rejects_bad_depth():
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        prefetch([], "cpu", depth=0)


@pytest.mark.gpu
def test_stream_safety_consumer_overwrites_and_frees():
    """The consumer clobbers and frees each batch while the next copies are in flight; sums stay exact."""
    n, size = 2000, 1 << 16
    src = [torch.full((size,), i % 251, dtype=torch.int32) for i in range(64)]
    expected = [int(s.sum()) for s in src]
    it = prefetch((src[i % 64] for i in range(n)), "cuda", depth=3)
    for i, batch in enumerate(it):
        got = int(batch.sum())
        assert got == expected[i % 64], i
        batch.fill_(-1)  # overwrite on the consumer stream
        del batch
    torch.cuda.synchronize()


class _Staged:
    """A transform split in two that logs its calls; finish(k) must see start(k)'s work."""

    def __init__(self, fail_at=None):
        self.log, self.fail_at = [], fail_at

    def start(self, batch):
        self.log.append(("start", int(batch[0])))
        return batch * 2

    def finish(self, started):
        k = int(started[0]) // 2
        self.log.append(("finish", k))
        if k == self.fail_at:
            raise ValueError(f"finish failed at {k}")
        return started + 1


@pytest.mark.gpu
def test_a_staged_transform_runs_one_batch_deep_and_every_start_is_finished():
    t = _Staged()
    out = [int(b[0]) for b in prefetch((torch.full((4,), i) for i in range(5)), "cuda", transform=t)]
    assert out == [2 * i + 1 for i in range(5)]
    assert t.log == [("start", 0), ("start", 1), ("finish", 0), ("start", 2), ("finish", 1), ("start", 3),
                     ("finish", 2), ("start", 4), ("finish", 3), ("finish", 4)]
    t = _Staged()
    for i, b in enumerate(prefetch((torch.full((4,), i) for i in range(100)), "cuda", transform=t)):
        if i == 1:
            break
    starts = {k for what, k in t.log if what == "start"}
    assert starts == {k for what, k in t.log if what == "finish"} and len(starts) < 100  # stopped early
    t = _Staged(fail_at=2)
    with pytest.raises(ValueError, match="finish failed at 2"):
        list(prefetch((torch.full((4,), i) for i in range(6)), "cuda", transform=t))
    assert {k for what, k in t.log if what == "start"} <= {k for what, k in t.log if what == "finish"}


@pytest.mark.gpu
def test_on_take_says_whether_the_consumer_waited_for_a_batch():
    """A slow source: the consumer finds none ready; a slow consumer: every batch after the first is ready."""
    import time

    from gpufeed import Prefetcher

    def slow(n):
        for i in range(n):
            time.sleep(0.05)
            yield torch.full((4,), i)

    waits = []
    assert len(list(Prefetcher(slow(6), "cuda", depth=2, on_take=waits.append))) == 6
    assert waits == [True] * 6
    waits.clear()
    for _ in Prefetcher((torch.full((4,), i) for i in range(6)), "cuda", depth=2, on_take=waits.append):
        time.sleep(0.05)
    assert len(waits) == 6 and waits[1:] == [False] * 5
