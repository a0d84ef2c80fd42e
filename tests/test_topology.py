import pytest

from dflash_mp.topology import DRAFTER, TARGET, Topology


@pytest.mark.parametrize("world,num_t", [(2, 1), (3, 1), (3, 2), (8, 3), (8, 1), (8, 7), (5, 2)])
def test_every_rank_paired_and_roles_partition(world, num_t):
    topo = Topology.plan(num_t, 0, world)
    assert sorted(topo.target_ranks + topo.drafter_ranks) == list(range(world))
    assert len(topo.target_ranks) == num_t
    assert all(topo.feeds[t] for t in topo.target_ranks)
    assert all(topo.sources[d] for d in topo.drafter_ranks)
    # feeds and sources describe the same pairs
    pairs_f = {(t, d) for t, ds in topo.feeds.items() for d in ds}
    pairs_s = {(t, d) for d, ts in topo.sources.items() for t in ts}
    assert pairs_f == pairs_s


@pytest.mark.parametrize("world,num_t", [(3, 1), (3, 2), (8, 3), (7, 5)])
def test_step_schedule_matches_on_both_sides(world, num_t):
    topo = Topology.plan(num_t, 0, world)
    steps = 23
    for t in topo.target_ranks:
        sends = [(s, d) for s in range(steps) for d in topo.sends_at_step(t, s)]
        recvs = [(s, d) for d in topo.drafter_ranks for s in range(steps) if topo.source_for_step(d, s) == t]
        assert sorted(sends) == sorted(recvs)
        assert topo.num_sends(t, steps) == len(sends)
    # every drafter consumes exactly one batch per step
    for d in topo.drafter_ranks:
        assert all(topo.source_for_step(d, s) in topo.sources[d] for s in range(steps))


def test_multi_node_pairs_stay_on_their_node():
    topo = Topology.plan(4, 0, 16, ranks_per_node=8)
    assert topo.target_ranks == (0, 1, 8, 9)
    for t, ds in topo.feeds.items():
        assert all(topo.same_node(t, d) for d in ds)


def test_roles_and_leaders():
    assert Topology.plan(2, 1, 4).role == TARGET
    d = Topology.plan(2, 3, 4)
    assert d.role == DRAFTER and d.role_rank == 1 and not d.is_role_leader


@pytest.mark.parametrize("world,num_t", [(4, 0), (4, 4), (2, 5)])
def test_impossible_split_names_value_and_fix(world, num_t):
    with pytest.raises(ValueError, match=rf"num_target_ranks={num_t}.*choose a value from 1 to {world - 1}"):
        Topology.plan(num_t, 0, world)


def test_single_process_is_refused_with_fix():
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        Topology.plan(1, 0, 1)
