"""Transport over torch.distributed point-to-point, on real gloo processes.

The rank functions here take the transport `kind` as an argument: test_transport_shm.py runs the
same scenarios over shared memory.
"""

from __future__ import annotations

import time

import pytest
import torch
from dist_utils import RankFailure, run_ranks

from dflash_mp.batch import HiddenBatch
from dflash_mp.topology import Topology
from dflash_mp.transport import SlotSpec, TransportConfig, build_transport

T, H = 16, 8


# ---------------------------------------------------------------- shared rank-side helpers
def make_batch(src: int, dst: int, seq: int, dtype=torch.float32, device="cpu") -> HiddenBatch:
    """Content derived from (src, dst, seq) only, so the receiver can rebuild what it must get."""
    g = torch.Generator().manual_seed(src * 1_000_003 + dst * 10_007 + seq)
    ar = torch.arange(T)
    batch = HiddenBatch(
        hidden=torch.randn(T, H, generator=g).to(dtype),
        input_ids=ar + 1000 * seq + 1_000_000 * src + 100_000 * dst,
        position_ids=ar % 5,
        doc_ids=ar // 5,
        loss_mask=(ar + seq) % 2,
        num_valid_tokens=T - seq % 3,
    )
    return batch.to(device)


def check_batch_content(got: HiddenBatch, src: int, dst: int, seq: int) -> None:
    want = make_batch(src, dst, seq, got.hidden.dtype)
    got = got.to("cpu")
    assert got.seq == seq
    bits = torch.equal(got.hidden.view(torch.uint8), want.hidden.view(torch.uint8))
    assert bits, f"hidden differs at seq {seq}"
    for name in ("input_ids", "position_ids", "doc_ids", "loss_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{name} differs at seq {seq}"
    if got.num_valid_tokens != -1:  # -1: not read on the GPU hot path
        assert got.num_valid_tokens == want.num_valid_tokens


def setup(rank, world, num_targets, kind, depth=2, timeout_s=20.0, dtype=torch.float32, device="cpu", **cfg):
    topo = Topology.plan(num_targets, rank, world).init_groups("gloo")
    spec = SlotSpec(T, H, dtype, torch.device(device))
    cfg = TransportConfig(kind=kind, depth=depth, timeout_s=timeout_s, **cfg)
    transport = build_transport(cfg, topo, spec)
    return topo, transport


def rank_stream(rank, world, kind, num_batches, depth, dtype_name, consumer_delay_s=0.0, device="cpu",
                cfg=None):
    """1 target -> 1 drafter: order, bit-exact payload, slot identity, back-pressure, end of data."""
    dtype = getattr(torch, dtype_name)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    topo, tr = setup(rank, world, 1, kind, depth=depth, dtype=dtype, device=device, **(cfg or {}))
    with tr:
        out = {"names": [getattr(ch, "segment_name", None) for ch in tr._channels.values()]}
        if topo.role == "target":
            dst = topo.feeds[rank][0]
            in_flight, returned, stall_ms, sent = [], [], 0.0, 0
            for seq in range(num_batches):
                tr.send(dst, make_batch(rank, dst, seq, dtype, device))
                returned.append(time.monotonic())
                stats = tr.stats()  # stall_ms and bytes_sent count since the previous call
                in_flight.append(stats["in_flight"])
                stall_ms, sent = stall_ms + stats["stall_ms"], sent + stats["bytes_sent"]
            tr.finish()
            tr.verify()
            out.update(returned=returned, in_flight=in_flight, stall_ms=stall_ms, bytes_sent=sent)
        else:
            src = topo.sources[rank][0]
            called, ptrs, ids = [], [], []
            for seq in range(num_batches):
                time.sleep(consumer_delay_s)
                called.append(time.monotonic())
                b = tr.recv(src)
                check_batch_content(b, src, rank, seq)
                ptrs.append((b.hidden.data_ptr(), b.input_ids.data_ptr(), b.loss_mask.data_ptr()))
                ids.append((id(b.hidden), id(b.input_ids), id(b.doc_ids)))
            tr.expect_end(src)
            tr.verify()
            out.update(called=called, ptrs=ptrs, ids=ids, **tr.stats())
    return out


def rank_fan(rank, world, kind, num_targets, num_steps):
    """Several pairs at once, in the trainer's step order (Topology.sends_at_step / source_for_step)."""
    topo, tr = setup(rank, world, num_targets, kind)
    with tr:
        if topo.role == "target":
            sent = {dst: 0 for dst in topo.feeds[rank]}
            for step in range(num_steps):
                for dst in topo.sends_at_step(rank, step):
                    tr.send(dst, make_batch(rank, dst, sent[dst]))
                    sent[dst] += 1
            tr.finish()
            return {"sent": sent}
        seqs = {src: 0 for src in topo.sources[rank]}
        for step in range(num_steps):
            src = topo.source_for_step(rank, step)
            check_batch_content(tr.recv(src), src, rank, seqs[src])
            seqs[src] += 1
        for src in topo.sources[rank]:
            tr.expect_end(src)
        return {"received": seqs}


def rank_silent(rank, world, kind, silent_role, timeout_s, linger_s):
    """One side never shows up: the other must raise naming it after about timeout_s."""
    topo, tr = setup(rank, world, 1, kind, timeout_s=timeout_s)
    with tr:
        if topo.role == silent_role:
            time.sleep(linger_s)  # alive, just silent
            return None
        t0 = time.monotonic()
        try:
            if topo.role == "target":
                for seq in range(10):  # the first `depth` go out without credit
                    tr.send(1, make_batch(0, 1, seq))
            else:
                tr.recv(0)
        except RuntimeError as e:
            return {"error": str(e), "elapsed": time.monotonic() - t0}
        return {"error": None}


def rank_end_mismatch(rank, world, kind, num_sent, num_recv):
    """The drafter takes `num_recv` batches then expects the end; the target sent `num_sent`."""
    topo, tr = setup(rank, world, 1, kind, timeout_s=5.0)
    with tr:
        if topo.role == "target":
            for seq in range(num_sent):
                tr.send(1, make_batch(0, 1, seq))
            tr.finish()
            return "finished"
        for seq in range(num_recv):
            try:
                tr.recv(0)
            except RuntimeError as e:
                return f"recv {seq}: {e}"
        try:
            tr.expect_end(0)
        except RuntimeError as e:
            return f"expect_end: {e}"
        return "ended"


# ---------------------------------------------------------------- shared assertions
def check_stream(results, depth, num_batches):
    tgt, dft = results
    assert dft["called"] and len(dft["ptrs"]) == num_batches
    # Slots: `depth` fixed buffers, cycled in order, the very same tensor objects each time round.
    assert len(set(dft["ptrs"])) == depth
    assert all(dft["ptrs"][i] == dft["ptrs"][i % depth] for i in range(num_batches))
    assert all(dft["ids"][i] == dft["ids"][i % depth] for i in range(num_batches))
    # Credits: never more than `depth` unacknowledged batches on the pair.
    assert max(tgt["in_flight"]) <= depth
    assert tgt["bytes_sent"] == dft["bytes_received"] > 0
    return tgt, dft


def check_backpressure(results, depth):
    tgt, dft = results
    # send(j) may only return once the drafter has asked for batch j-depth+1 (which returns the
    # credit of batch j-depth).
    for j in range(depth, len(tgt["returned"])):
        assert tgt["returned"][j] >= dft["called"][j - depth + 1], f"send {j} returned before its credit"


def check_silent(results, silent_role, timeout_s, peer_text):
    waiter = results[1] if silent_role == "target" else results[0]
    assert waiter["error"] is not None, "the waiting side did not raise"
    assert peer_text in waiter["error"], waiter["error"]
    assert 0.8 * timeout_s <= waiter["elapsed"] <= timeout_s + 2.0


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_stream_order_exact_slots_end(dtype_name):
    depth, n = 2, 60
    tgt, dft = check_stream(run_ranks(rank_stream, 2, "p2p", n, depth, dtype_name, timeout=60), depth, n)
    assert tgt["bytes_sent"] == n * (4 + 4 * T) * 8 + n * T * H * getattr(torch, dtype_name).itemsize
    assert tgt["stall_ms"] < 2000  # a consumer that keeps up barely stalls the target


def test_backpressure_slow_consumer():
    depth, n, delay = 3, 12, 0.03
    results = run_ranks(rank_stream, 2, "p2p", n, depth, "float32", delay, timeout=60)
    tgt, _ = check_stream(results, depth, n)
    check_backpressure(results, depth)
    assert max(tgt["in_flight"]) == depth
    assert tgt["stall_ms"] > 0.5 * (n - depth) * delay * 1e3  # the target waited for the slow drafter


@pytest.mark.parametrize("num_targets", [1, 2], ids=["1to2", "2to1"])
def test_multiple_pairs(num_targets):
    results = run_ranks(rank_fan, 3, "p2p", num_targets, 20, timeout=60)
    if num_targets == 1:
        assert results[0]["sent"] == {1: 20, 2: 20}
        assert results[1]["received"] == {0: 20} and results[2]["received"] == {0: 20}
    else:
        assert results[2]["received"] == {0: 10, 1: 10}


@pytest.mark.parametrize("silent_role", ["target", "drafter"])
def test_timeout_names_the_silent_peer(silent_role):
    timeout_s = 1.0
    results = run_ranks(rank_silent, 2, "p2p", silent_role, timeout_s, timeout_s + 1.0, timeout=30)
    text = "no data from target rank 0" if silent_role == "target" else "no credit from drafter rank 1"
    check_silent(results, silent_role, timeout_s, text)


def test_end_of_data_mismatches():
    # Fewer batches than the drafter wants: recv() reports the early end-of-data.
    results = run_ranks(rank_end_mismatch, 2, "p2p", 2, 3, timeout=60, allow_failures=True)
    assert "recv 2" in results[1] and "end-of-data at seq 2" in results[1]
    # More batches than the drafter takes: expect_end() reports the extra batch; the target then
    # fails naming the drafter instead of waiting forever.
    results = run_ranks(rank_end_mismatch, 2, "p2p", 3, 2, timeout=60, allow_failures=True)
    assert "expect_end" in results[1] and "expected end-of-data" in results[1]
    assert isinstance(results[0], RankFailure) and "drafter rank 1" in results[0].error


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
