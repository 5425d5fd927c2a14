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
    of the epoch's order no old rank delivered, up to where the epoch as begun would have ended (only
    padding repeats)."""
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
    if drop_last:  # only the tail the epoch as begun drops; the rest filled up to a whole round of ranks
        assert missing == set(old[0].full_order()[n - n % before:]) and extra <= after - 1
    else:  # everything, repeats only from padding (at most one round short of a multiple)
        assert not missing and extra <= (before - 1) + (after - 1)
    for s in new:
        s.advance(len(s.remaining()))
    assert {s.state_dict()["offset"] for s in new} == {n}  # the epoch is done


def test_a_state_saved_at_an_epochs_start_begins_that_epoch_on_the_new_ranks():
    """Saved before anything of the epoch was delivered (1 rank, batch 64), resumed on 4 ranks of batch 8: the
    epoch is begun there, so a second stop and resume within it ends where 4 x 8 ends it (96 of 100), not
    where the first configuration would have (64)."""
    n, world, batch = 100, 4, 8
    first = ShardedSampler(n, seed=4, world_size=1, batch_size=64, drop_last=True, epoch=1).state_dict()
    ranks = [ShardedSampler(n, seed=0, rank=r, world_size=world, batch_size=batch, drop_last=True)
             for r in range(world)]
    for s in ranks:
        s.load_state_dict(first)
    delivered = []
    for s in ranks:  # one batch each, then a checkpoint
        delivered += s.remaining()[:batch]
        s.advance(batch)
    again = ranks[0].state_dict()
    resumed = [ShardedSampler(n, seed=0, rank=r, world_size=world, batch_size=batch, drop_last=True)
               for r in range(world)]
    for s in resumed:
        s.load_state_dict(again)
        delivered += s.remaining()
    assert {len(s.remaining()) for s in resumed} == {2 * batch}  # equal batches on every rank
    whole = ShardedSampler(n, seed=4, world_size=1, epoch=1).full_order()[:96]
    assert sorted(delivered) == sorted(whole)  # exactly the epoch as 4 x 8 delivers it, nothing lost or twice


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


def _group_of(groups):
    """Sample index -> its group, for consecutive groups of these sizes."""
    return [g for g, size in enumerate(groups) for _ in range(size)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_grouped_order_deals_each_rank_its_own_groups_exactly_once(world, drop_last):
    """11 groups of 1-7 samples: over the ranks every sample once per epoch (DistributedSampler's padding or
    dropped tail aside), equal counts, the same for the same (seed, epoch, world size), and each rank reads
    about 1/world of the groups: its run's, the two ends it may share, and its padding sample's."""
    groups = (5, 3, 7, 1, 4, 6, 2, 5, 7, 3, 4)
    n, group_of = sum(groups), _group_of(groups)
    for epoch in (0, 1):
        ranks = [ShardedSampler(n, groups=groups, window=2, seed=4, epoch=epoch, rank=r, world_size=world,
                                drop_last=drop_last) for r in range(world)]
        shards = [s.epoch_indices() for s in ranks]
        assert {len(s) for s in shards} == {len(ranks[0])} and len(ranks[0]) == (n // world if drop_last else -(-n // world))
        counts = collections.Counter(i for s in shards for i in s)
        if drop_last:
            assert max(counts.values()) == 1 and len(counts) == n - n % world
        else:
            assert set(counts) == set(range(n)) and sum(counts.values()) == len(ranks[0]) * world
        # each cut between two runs splits at most one group, read by both; a padding sample adds at most one
        padding = 0 if drop_last else -n % world
        assert sum(len({group_of[i] for i in s}) for s in shards) <= len(groups) + (world - 1) + padding
        again = ShardedSampler(n, groups=groups, window=2, seed=4, epoch=epoch, rank=world - 1, world_size=world,
                               drop_last=drop_last)
        assert again.epoch_indices() == shards[-1]
    assert ShardedSampler(n, groups=groups, seed=4, epoch=0).epoch_indices() != \
        ShardedSampler(n, groups=groups, seed=4, epoch=1).epoch_indices()


def test_grouped_order_run_of_a_rank_holds_few_groups_at_scale():
    """64 shards of 100 (the last of 37) over 8 ranks: a rank's run of 792 samples spans 8 or 9 shards, and a
    rank with a padding sample reads one more."""
    groups = (100,) * 63 + (37,)
    group_of = _group_of(groups)
    ranks = [ShardedSampler(sum(groups), groups=groups, seed=1, rank=r, world_size=8) for r in range(8)]
    read = [{group_of[i] for i in s.epoch_indices()} for s in ranks]
    assert len(ranks[0]) == 793 and max(len(r) for r in read) <= 9 + 1 and min(len(r) for r in read) >= 8
    assert set().union(*read) == set(range(64))


def test_one_rank_grouped_order_is_the_order_saved_without_a_world_size():
    """One rank: the groups shuffled, then the samples of each window of that order; the order a state
    without ``order_world_size`` was saved with, so such a state resumes exactly on any world size."""
    import torch

    def one_rank(groups, window, seed):  # the one-rank grouped order, stated directly
        g = torch.Generator()
        g.manual_seed(seed)
        starts = [sum(groups[:k]) for k in range(len(groups) + 1)]
        perm = torch.randperm(len(groups), generator=g).tolist()
        out = []
        for w in range(0, len(perm), window):
            idx = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in perm[w : w + window]])
            out += idx[torch.randperm(len(idx), generator=g)].tolist()
        return out

    groups = (5, 3, 7, 1, 4, 6, 2)
    n = sum(groups)
    compared = 0
    for epoch in range(3):
        s = ShardedSampler(n, groups=groups, window=3, seed=6, epoch=epoch)
        assert s.epoch_indices() == one_rank(groups, 3, 6 + epoch)
        compared += 1
    assert compared == 3
    saved = ShardedSampler(n, groups=groups, window=3, seed=6, epoch=2, world_size=2)
    old = saved.state_dict()
    old["offset"] = 10
    del old["order_world_size"]
    rest = []
    for r in range(3):
        s = ShardedSampler(n, groups=groups, window=3, rank=r, world_size=3)
        s.load_state_dict(old)
        rest.append(s.remaining())
    tail = one_rank(groups, 3, 8)[10:]
    assert rest == [tail[r::3] for r in range(3)]  # 18 left: 6 for each of 3 ranks


@pytest.mark.parametrize("after", [3, 2, 1, 4])
def test_grouped_order_resumes_mid_epoch_on_any_world_size(after):
    """Saved on 3 ranks after 4 samples each; resumed on ``after`` ranks: exactly the samples no old rank
    delivered (padding aside), the same rest of the order a rank of 3 would have had when ``after`` is 3;
    saved again mid-way and resumed once more, still the rest of the order made for 3 ranks; the next
    epoch is dealt to the new ranks."""
    groups = (6, 2, 5, 7, 3, 4, 6, 1, 5)
    n = sum(groups)  # 39
    old = [ShardedSampler(n, groups=groups, window=2, seed=2, epoch=1, rank=r, world_size=3) for r in range(3)]
    delivered = []
    for s in old:
        delivered += s.remaining()[:4]
        s.advance(4)
    state = old[0].state_dict()
    assert state["offset"] == 12 and state["order_world_size"] == 3
    new = [ShardedSampler(n, groups=groups, window=2, rank=r, world_size=after) for r in range(after)]
    for s in new:
        s.load_state_dict(state)
        assert s.at_epoch_start is False
    if after == 3:
        assert [s.remaining() for s in new] == [s.remaining() for s in old]
    for s in new:  # one sample each, then saved and resumed on 2 ranks
        delivered += s.remaining()[:1]
        s.advance(1)
    again = new[0].state_dict()
    assert again["offset"] == 12 + after and again["order_world_size"] == 3
    last = [ShardedSampler(n, groups=groups, window=2, rank=r, world_size=2) for r in range(2)]
    for s in last:
        s.load_state_dict(again)
        delivered += s.remaining()
    counts = collections.Counter(delivered)
    assert set(counts) == set(range(n))
    assert sum(counts.values()) - n == -(n - 12 - after) % 2  # only the last world size's padding repeats
    full = ShardedSampler(n, groups=groups, window=2, seed=2, epoch=1, world_size=3).full_order()
    rest = full[12 + after :]
    rest += rest[: len(rest) % 2]  # DistributedSampler's padding to a multiple of 2
    assert [s.remaining() for s in last] == [rest[0::2], rest[1::2]]
    for s in last:
        s.set_epoch(2)
        assert s.at_epoch_start and s.state_dict()["order_world_size"] == 2
    fresh = [ShardedSampler(n, groups=groups, window=2, seed=2, epoch=2, rank=r, world_size=2) for r in range(2)]
    assert [s.epoch_indices() for s in last] == [s.epoch_indices() for s in fresh]


def test_units_keep_a_files_row_groups_together():
    """5 files of 2-4 row groups: with the files as units, one rank reads each file in one stretch of its
    order (a window may take the end of one and the start of the next), and 2 ranks read each file once,
    besides the one a cut splits and a padding sample's."""
    units = (3, 2, 4, 3, 2)
    groups = (4, 4, 3, 5, 5, 2, 2, 2, 6, 3, 3, 4, 6, 1)
    n, file_of = sum(groups), _group_of([sum(groups[sum(units[:f]) : sum(units[: f + 1])]) for f in range(5)])
    for epoch in range(3):
        order = ShardedSampler(n, groups=groups, units=units, window=2, seed=8, epoch=epoch).epoch_indices()
        spans = [(min(p for p, i in enumerate(order) if file_of[i] == f),
                  max(p for p, i in enumerate(order) if file_of[i] == f)) for f in range(5)]
        held = [sum(a <= p <= b for a, b in spans) for p in range(n)]  # files between their first and last sample
        assert sorted(order) == list(range(n)) and max(held) <= 2 and len(held) == n
        ranks = [ShardedSampler(n, groups=groups, units=units, window=2, seed=8, epoch=epoch, rank=r, world_size=2)
                 for r in range(2)]
        assert sum(len({file_of[i] for i in s.epoch_indices()}) for s in ranks) <= 5 + 1 + n % 2


def test_unshuffled_grouped_order_gives_each_rank_a_contiguous_run():
    groups = (4, 4, 4, 3)
    assert ShardedSampler(15, groups=groups, shuffle=False).epoch_indices() == list(range(15))
    runs = [ShardedSampler(15, groups=groups, shuffle=False, rank=r, world_size=2).epoch_indices() for r in range(2)]
    assert runs == [list(range(8)), list(range(8, 15)) + [0]]  # the padding: the full order's first entry


def test_grouped_order_settings_are_checked():
    with pytest.raises(ValueError, match=r"groups must be sizes >= 1, got 0 for group 1"):
        ShardedSampler(5, groups=(5, 0))
    with pytest.raises(ValueError, match=r"units must be counts >= 1 .* 3 groups, got \(2, 2\)"):
        ShardedSampler(9, groups=(3, 3, 3), units=(2, 2))
    saved = ShardedSampler(9, groups=(3, 3, 3), window=2).state_dict()
    with pytest.raises(ValueError, match="order_world_size must be an integer >= 1, got 0"):
        ShardedSampler(9, groups=(3, 3, 3), window=2).load_state_dict(dict(saved, order_world_size=0))
    with pytest.raises(ValueError, match="grouped order.*differ in units"):  # files kept together: another order
        ShardedSampler(9, groups=(3, 3, 3), window=2, units=(1, 2)).load_state_dict(saved)


def test_a_grouped_state_saved_at_an_epochs_start_resumes_with_the_new_world_sizes_own_order():
    groups = (4, 6, 5, 5, 7, 3, 6, 4)
    saved = ShardedSampler(40, groups=groups, seed=2, rank=0, world_size=3)
    saved.set_epoch(1)
    state = saved.state_dict()
    assert state["offset"] == 0 and state["order_world_size"] == 3
    compared = 0
    for r in range(2):
        resumed = ShardedSampler(40, groups=groups, seed=2, rank=r, world_size=2)
        resumed.load_state_dict(state)
        fresh = ShardedSampler(40, groups=groups, seed=2, rank=r, world_size=2, epoch=1)
        assert resumed.epoch_indices() == fresh.epoch_indices() and resumed.at_epoch_start
        compared += len(fresh.epoch_indices())
    assert compared == 40


@pytest.mark.parametrize("groups", [None, (5, 3, 7, 2, 6, 4, 3)])
def test_an_epochs_order_asked_ahead_is_that_epochs_own_order(groups):
    """The next epoch's order, asked for while this one runs (the scheduler starts its first batches early),
    mid-epoch and after a resume, is the one that epoch gives once it is set: its seed, its whole shard."""
    for rank in range(2):
        fresh = ShardedSampler(30, seed=4, rank=rank, world_size=2, groups=groups, window=2)
        fresh.set_epoch(3)
        running = ShardedSampler(30, seed=4, rank=rank, world_size=2, groups=groups, window=2, epoch=2)
        running.advance(5)
        resumed = ShardedSampler(30, seed=0, rank=rank, world_size=2, groups=groups, window=2)
        resumed.load_state_dict(running.state_dict())
        for s in (running, resumed):
            assert s.epoch_indices(3) == fresh.epoch_indices() and len(fresh.epoch_indices()) == 15
            assert s.full_order(3) == fresh.full_order() != s.full_order(2)


@pytest.mark.parametrize("after", [1, 2])
def test_a_loader_resumed_without_drop_last_delivers_the_rest_once_not_filled_to_whole_batches(synth_root, after):
    """Without drop_last a resumed epoch is padded to one sample per rank, not to whole batches: 40 samples,
    batch 6, saved after one batch on one rank: the 34 entries left come once each, 34 / ``after`` per rank,
    and the last batch is short (a rest padded to whole batches would repeat 2 of them)."""
    from gpufeed import ImageLoader

    kw = dict(batch_size=6, image_size=16, num_workers=1, device="cpu", train=True, drop_last=False, seed=4)
    with ImageLoader(synth_root, **kw) as first:
        order = first.sampler.full_order()
        next(iter(first))
        assert first.batch_indices == order[:6]
        state = first.state_dict()
    delivered = []
    for rank in range(after):
        with ImageLoader(synth_root, rank=rank, world_size=after, **kw) as resumed:
            resumed.load_state_dict(state)
            sizes = []
            for _, labels in resumed:
                sizes.append(len(labels))
                delivered += resumed.batch_indices
            per_rank = 34 // after
            assert sum(sizes) == per_rank and sizes == [6] * (per_rank // 6) + ([per_rank % 6] if per_rank % 6 else [])
    assert sorted(delivered) == sorted(order[6:])
