import collections

import pytest
from torch.utils.data import DistributedSampler

from gpufeed.sampling import ShardedSampler, resolve_rank


@pytest.mark.parametrize("n, world, drop_last", [(10, 1, False), (10, 3, False), (10, 3, True), (7, 4, False)])
def test_same_order_as_distributed_sampler(n, world, drop_last):
    for rank in range(world):
        for epoch in (0, 3):
            ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=5,
                                     drop_last=drop_last)
            ref.set_epoch(epoch)
            s = ShardedSampler(n, seed=5, rank=rank, world_size=world, drop_last=drop_last)
            s.set_epoch(epoch)
            assert s.epoch_indices() == list(ref)
            assert len(s) == len(ref)


def test_ranks_partition_the_epoch():
    shards = [ShardedSampler(12, seed=0, rank=r, world_size=3).epoch_indices() for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(12))


def test_order_depends_on_seed_and_epoch_only():
    a, b = ShardedSampler(50, seed=1), ShardedSampler(50, seed=1)
    assert a.epoch_indices() == b.epoch_indices()
    b.set_epoch(1)
    assert a.epoch_indices() != b.epoch_indices()
    assert ShardedSampler(50, seed=2).epoch_indices() != a.epoch_indices()


def test_state_dict_resumes_the_rest_in_order():
    s = ShardedSampler(20, seed=3)
    s.set_epoch(2)
    full = s.epoch_indices()
    s.advance(7)
    state = s.state_dict()
    t = ShardedSampler(20, seed=0)
    t.load_state_dict(state)
    assert t.remaining() == full[7:]


@pytest.mark.parametrize("n, before, after, drop_last", [(40, 3, 2, False), (40, 3, 2, True), (41, 2, 3, False),
                                                      (37, 4, 1, True), (10, 1, 4, False)])
def test_elastic_resume_delivers_the_rest_of_the_epoch_once(n, before, after, drop_last):
    """Ranks in lockstep save after p samples each; any other world size continues with exactly the entries
    of the epoch's order no old rank delivered (only DistributedSampler's own padding repeats)."""
    old = [ShardedSampler(n, seed=9, rank=r, world_size=before, drop_last=drop_last, epoch=2) for r in range(before)]
    p = len(old[0]) // 2
    delivered = []
    for s in old:
        delivered += s.remaining()[:p]
        s.advance(p)
    states = [s.state_dict() for s in old]
    assert all(st == states[0] for st in states) and states[0]["offset"] == p * before  # one state for every rank
    new = [ShardedSampler(n, seed=0, rank=r, world_size=after, drop_last=drop_last) for r in range(after)]
    for s in new:
        s.load_state_dict(states[0])
        delivered += s.remaining()
    counts = collections.Counter(delivered)
    missing = set(range(n)) - set(counts)
    extra = sum(counts.values()) - len(counts)
    if drop_last:  # each world size may drop at most its ragged tail, never repeats
        assert extra == 0 and len(missing) <= (before - 1) + (after - 1)
    else:  # everything, repeats only from padding (at most one round short of a multiple)
        assert not missing and extra <= (before - 1) + (after - 1)
    for s in new:
        s.advance(len(s.remaining()))
    assert {s.state_dict()["offset"] for s in new} == {n}  # the epoch is done


def test_an_old_state_without_offset_needs_the_same_world_size():
    old = {"epoch": 1, "position": 3, "seed": 2, "world_size": 2, "num_samples_total": 20}
    s = ShardedSampler(20, world_size=2, rank=1)
    s.load_state_dict(old)
    assert s.remaining() == ShardedSampler(20, seed=2, world_size=2, rank=1, epoch=1).epoch_indices()[3:]
    with pytest.raises(ValueError, match="world_size=2 and no offset"):
        ShardedSampler(20, world_size=4).load_state_dict(old)
    with pytest.raises(ValueError, match="num_samples_total=20, this loader has 21"):
        ShardedSampler(21).load_state_dict(old)


def test_resolve_rank_defaults_and_errors(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_rank(None, None) == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun's, before init_process_group: still this rank's shard
    assert resolve_rank(None, None) == (2, 4)
    assert resolve_rank(None, 1) == (0, 1) and resolve_rank(1, 2) == (1, 2)  # the caller's own sharding
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\), got 2"):
        resolve_rank(2, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        resolve_rank(0, 0)


def test_grouped_order_takes_a_window_of_groups_at_a_time():
    """Groups (shards) of 5, 3, 4, 6, 2, 5 samples, window 2: each epoch is a permutation of all samples in
    which every run of two groups' samples comes whole before the next, differently each epoch."""
    groups = (5, 3, 4, 6, 2, 5)
    starts = [0, 5, 8, 12, 18, 20, 25]
    group_of = {i: g for g in range(6) for i in range(starts[g], starts[g + 1])}
    orders = []
    for epoch in range(2):
        order = ShardedSampler(25, groups=groups, window=2, seed=7, epoch=epoch).epoch_indices()
        assert sorted(order) == list(range(25))
        seen: list[set[int]] = []
        for i in order:
            if not seen or (group_of[i] not in seen[-1] and len(seen[-1]) == 2):
                seen.append(set())
            seen[-1].add(group_of[i])
        assert len(seen) == 3 and set().union(*seen) == set(range(6))
        assert sum(len(window) for window in seen) == 6  # no group is split across windows
        orders.append(order)
    assert orders[0] != orders[1]


def test_grouped_order_is_exactly_once_across_ranks_and_resumes_elastically():
    groups = (4,) * 10
    full = [ShardedSampler(40, groups=groups, seed=1, rank=r, world_size=3).epoch_indices() for r in range(3)]
    counts = collections.Counter(i for shard in full for i in shard)
    assert set(counts) == set(range(40)) and sum(counts.values()) == 42
    first = [ShardedSampler(40, groups=groups, seed=1, rank=r, world_size=3) for r in range(3)]
    done = []
    for s in first:
        done += s.epoch_indices()[:5]
        s.advance(5)
    rest = []
    for r in range(2):
        s = ShardedSampler(40, groups=groups, seed=1, rank=r, world_size=2)
        s.load_state_dict(first[0].state_dict())
        rest += s.remaining()
    counts = collections.Counter(done + rest)  # 25 left over 2 ranks: one entry of padding
    assert set(counts) == set(range(40)) and sum(counts.values()) == 41


def test_groups_must_add_up():
    with pytest.raises(ValueError, match="groups hold 9 samples, num_samples_total=10"):
        ShardedSampler(10, groups=(4, 5))


def test_a_grouped_order_resumes_only_with_the_same_grouping():
    saved = ShardedSampler(20, groups=(5,) * 4, window=2, seed=3)
    saved.advance(7)
    recut = ShardedSampler(20, groups=(4, 6, 5, 5), window=2, seed=3)  # as many groups, as many samples
    for other in (ShardedSampler(20, seed=3), ShardedSampler(20, groups=(5,) * 4, window=4, seed=3), recut):
        with pytest.raises(ValueError, match="grouped order"):
            other.load_state_dict(saved.state_dict())
    same = ShardedSampler(20, groups=(5,) * 4, window=2, seed=3)
    same.load_state_dict(saved.state_dict())
    assert same.remaining() == saved.remaining()
