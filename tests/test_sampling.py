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


def test_state_dict_rejects_another_world_size():
    s = ShardedSampler(20, world_size=2)
    with pytest.raises(ValueError, match="world_size=2"):
        ShardedSampler(20, world_size=4).load_state_dict(s.state_dict())


def test_resolve_rank_defaults_and_errors():
    assert resolve_rank(None, None) == (0, 1)
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\), got 2"):
        resolve_rank(2, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        resolve_rank(0, 0)
