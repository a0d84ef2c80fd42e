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


# ------------------------------------------------------------------------- staged targets (target.stages)
def test_staged_replicas_are_consecutive_ranks_and_only_last_stages_feed():
    topo = Topology.plan(4, 0, 8, stages=2)
    assert topo.target_ranks == (0, 1, 2, 3) and topo.drafter_ranks == (4, 5, 6, 7)
    assert topo.replicas == ((0, 1), (2, 3)) and topo.stages == 2 and topo.num_replicas == 2
    assert topo.feeds == {1: (4, 6), 3: (5, 7)}
    assert topo.sources == {4: (1,), 5: (3,), 6: (1,), 7: (3,)}
    assert [topo.stage_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert [topo.feeder_of(r) for r in range(4)] == [1, 1, 3, 3]
    assert (topo.prev_stage(0), topo.next_stage(0), topo.prev_stage(1), topo.next_stage(1)) == (None, 1, 0, None)
    assert topo.stage_links == [(0, 1, 0), (2, 3, 0)]
    assert topo.replica_index(3) == 1 and topo.replica_of(2) == (2, 3)


@pytest.mark.parametrize("num_t,stages,replicas", [
    (4, 2, ((0, 1), (8, 9))),
    (8, 4, ((0, 1, 2, 3), (8, 9, 10, 11))),
    (6, 2, ((0, 1), (2, 3), (8, 9))),
])
def test_staged_replicas_spread_over_nodes_and_feed_drafters_of_their_node(num_t, stages, replicas):
    topo = Topology.plan(num_t, 0, 16, ranks_per_node=8, stages=stages)
    assert topo.replicas == replicas
    assert all(topo.same_node(rep[0], rep[-1]) for rep in topo.replicas)
    assert set(topo.feeds) == {rep[-1] for rep in replicas}
    for t, ds in topo.feeds.items():
        assert ds and all(topo.same_node(t, d) for d in ds)
    assert sorted(d for ds in topo.feeds.values() for d in ds) == list(topo.drafter_ranks)
    assert all(set(ts) <= set(topo.feeds) for ts in topo.sources.values())


@pytest.mark.parametrize("num_t,world,stages", [(4, 8, 2), (2, 7, 2), (6, 8, 3), (4, 5, 4)])
def test_every_stage_of_a_replica_sends_for_the_same_steps_as_its_feeder(num_t, world, stages):
    topo = Topology.plan(num_t, 0, world, stages=stages)
    steps = 23
    for rep in topo.replicas:
        feeder = rep[-1]
        recvs = [(s, d) for d in topo.drafter_ranks for s in range(steps) if topo.source_for_step(d, s) == feeder]
        for r in rep:
            sends = [(s, d) for s in range(steps) for d in topo.sends_at_step(r, s)]
            assert sorted(sends) == sorted(recvs)
            assert topo.num_sends(r, steps) == len(recvs)
    assert sum(topo.num_sends(rep[0], steps) for rep in topo.replicas) == steps * len(topo.drafter_ranks)


def test_a_stage_rank_is_named_with_its_stage():
    topo = Topology.plan(4, 0, 8, stages=2)
    assert topo.name(2) == "target rank 2 (stage 0 of 2)"
    assert topo.name(3) == "target rank 3 (stage 1 of 2)"
    assert topo.name(5) == "drafter rank 5"
    assert Topology.plan(2, 0, 8).name(1) == "target rank 1"
    assert "2 replica(s) x 2 stages: 0->1, 2->3" in topo.describe()


def test_target_ranks_not_a_multiple_of_the_stages_names_the_fix():
    with pytest.raises(ValueError, match=r"num_target_ranks=3 is not a multiple of target.stages=2.*"
                                         r"use num_target_ranks=2 \(or another multiple of 2\)"):
        Topology.plan(3, 0, 8, stages=2)
    with pytest.raises(ValueError, match=r"use num_target_ranks=4 \(or another multiple of 4\)"):
        Topology.plan(3, 0, 8, stages=4)


def test_a_replica_larger_than_a_node_names_the_fix():
    with pytest.raises(ValueError, match=r"target.stages=4 with topology.num_target_ranks=4: node\(s\) of 2 ranks"
                                         r".*fewer target ranks, fewer stages, or more ranks per node"):
        Topology.plan(4, 0, 8, ranks_per_node=2, stages=4)
    # 3 replicas of 3 over 2 nodes of 5 ranks: one node would hold 2 replicas (6 ranks).
    with pytest.raises(ValueError, match=r"node\(s\) of 5 ranks would hold 2 replica\(s\) of 3 stages"):
        Topology.plan(9, 0, 10, ranks_per_node=5, stages=3)


@pytest.mark.parametrize("stages", [0, -1])
def test_stages_below_one_names_the_fix(stages):
    with pytest.raises(ValueError, match=rf"target.stages={stages}: use 1 \(the whole target on one rank\) or more"):
        Topology.plan(2, 0, 4, stages=stages)
