"""Rank-side scenarios and checks shared by the transport tests (p2p and shm run the same ones).

Each rank function takes the transport `kind`; `dist_utils.run_ranks` runs it on real gloo processes.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from dflash_mp.batch import HiddenBatch
from dflash_mp.topology import Topology
from dflash_mp.transport import SlotSpec, TransportConfig, build_transport, p2p_pairs

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
    cfg = TransportConfig(kind=kind, depth=depth, timeout_s=timeout_s, **cfg)
    topo = Topology.plan(num_targets, rank, world)
    cuda = str(device).startswith("cuda")
    if cuda:  # as the trainer places ranks: NCCL wherever the members own distinct GPUs
        topo = dataclasses.replace(topo, gpus_per_node=torch.cuda.device_count())
    topo.init_groups("auto" if cuda else "gloo", p2p_pairs=p2p_pairs(cfg, topo))
    spec = SlotSpec(T, H, dtype, torch.device(device))
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
