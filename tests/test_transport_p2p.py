"""Transport over torch.distributed point-to-point: what is particular to it (which pairs may use
shm, NCCL on two GPUs). The scenarios every transport passes are in test_transport.py."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from transport_utils import check_backpressure, check_stream, rank_stream

from dflash_mp.topology import Topology
from dflash_mp.transport import TransportConfig


def test_shm_kind_refuses_cross_node_pairs():
    from dflash_mp.transport import pair_kinds

    topo = Topology.plan(2, 0, 4, ranks_per_node=2)  # pairs stay node-local: 0->1, 2->3
    assert set(pair_kinds(TransportConfig(kind="auto"), topo).values()) == {"shm"}
    topo = Topology.plan(1, 0, 4, ranks_per_node=2)  # node 1 has no target: 0 feeds 1, 2, 3
    assert pair_kinds(TransportConfig(kind="auto"), topo) == {(0, 1): "shm", (0, 2): "p2p", (0, 3): "p2p"}
    with pytest.raises(ValueError, match="different nodes.*kind=auto"):
        pair_kinds(TransportConfig(kind="shm"), topo)
    with pytest.raises(ValueError, match="depth"):
        pair_kinds(TransportConfig(depth=0), topo)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_stream():
    depth, n = 2, 60
    kw = {"backend": "cpu:gloo,cuda:nccl", "timeout": 180, "start_method": "spawn"}
    results = run_ranks(rank_stream, 2, "p2p", n, depth, "bfloat16", 0.0, "cuda", **kw)
    check_stream(results, depth, n)
    results = run_ranks(rank_stream, 2, "p2p", 12, 3, "bfloat16", 0.03, "cuda", **kw)
    check_backpressure(results, 3)
