"""How evenly the drafter's block-attention kernels spread their work over a GPU's SMs, on CPU.

    python bench/dkv_balance.py [--preset qwen3_8b] [--sms 132] [--resident 1]

For the bench's packed rows (`common.synthetic_batch`, seeds 0-3, anchors as the trainer draws them)
this counts each program's work in key tiles, as the kernels walk them (model/block_attn.py):

- dK/dV: a program per (context tile of BLOCK_N2 rows, KV head) visits every block whose span touches
  its tile, one block (G*B query rows) per iteration;
- dQ (the forward walks the same spans): a program per (q_blocks blocks, KV head) walks the key tiles of
  its blocks' spans (DQ_BLOCK_N rows each), then their own keys.

It then hands the programs to `--sms` SMs in the grid's order, each SM holding `--resident` programs and
giving each its share of time, and prints a perfect spread's time over the time the last SM finishes
(1.0: no SM idles before the end), for the grid with the KV heads first (a kernel in block_attn.HEADS_FIRST,
as dK/dV is: every head's program of a place before the next place, longest first over all heads) and head
by head (the others). `pairs`: the (query, key) pairs the mask allows over those the visited tiles compute.
Both bound what re-tiling or re-ordering a kernel can win: SMs idling at the end, and masked pairs.
A model, not a timing: it assumes a tile takes the same time in every program.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DRAFTERS, synthetic_batch  # noqa: E402

from dflash_mp.model import block_attn  # noqa: E402
from dflash_mp.model.anchors import sample_anchors  # noqa: E402


def spread(work: list[int], sms: int, resident: int) -> float:
    """Perfect-spread time over the finish time of `work` (tiles per program, in dispatch order) on `sms`
    SMs of `resident` slots each; a slot runs a tile in `resident` time units (its SM's share)."""
    slots = [(0.0, s) for s in range(sms * resident)]
    heapq.heapify(slots)
    for w in work:
        t, s = heapq.heappop(slots)
        heapq.heappush(slots, (t + w * resident, s))
    return (sum(work) / sms) / max(t for t, _ in slots)


def dispatch(per_place: list[int], kv_heads: int, heads_first: bool) -> list[int]:
    """Work per program in the order the GPU starts them (program_id(0) fastest)."""
    if heads_first:
        return [w for w in per_place for _ in range(kv_heads)]
    return [w for _ in range(kv_heads) for w in per_place]


def programs(p: dict, seed: int) -> dict:
    """Per kernel: (work per place in its order, allowed pairs, computed pairs) for one row."""
    T, A, B = p["seq_len"], p["anchors"], p["block"]
    hkv = p["kv"]
    rows_per_block = p["heads"] // hkv * B
    b = synthetic_batch(T, 8, 1000, "cpu", torch.float32, seed=seed)  # ids and masks only matter here
    anchors, valid = sample_anchors(b.loss_mask, b.doc_ids, A, A, generator=torch.Generator().manual_seed(seed))
    tiles = block_attn.TILES
    sp = block_attn.block_spans(anchors, valid, b.doc_ids, B, key_tile=tiles["BLOCK_N2"])
    span = (sp.end - sp.start).clamp(min=0)
    context = int(span.sum()) * B  # allowed (query, context key) pairs of one query head
    own = int(valid.sum()) * B * B  # ... and (query, own block key) pairs
    # dK/dV: tile t visits blocks [lo_t, hi_t); an iteration computes BLOCK_N2 x G*B pairs.
    per_tile = (sp.hi - sp.lo).tolist()
    dkv = [per_tile[t] for t in sp.tile_order.tolist()]
    dkv_pairs = sum(per_tile) * tiles["BLOCK_N2"] * B
    # dQ (and the forward, with BLOCK_N): q_blocks consecutive blocks walk the union of their spans.
    nb = block_attn.blocks_per_program(tiles["q_blocks"], rows_per_block)
    n = tiles["DQ_BLOCK_N"]
    start, end = sp.start.tolist(), sp.end.tolist()
    walk = []
    for i0 in range(0, A, nb):
        grp = [i for i in range(i0, min(i0 + nb, A))]
        lo1, hi1 = start[grp[0]], end[grp[0]]
        k = -(-(hi1 - lo1) // n) if hi1 > lo1 else 0
        if nb == 2 and len(grp) == 2:
            s2, e2 = start[grp[1]], end[grp[1]]
            if s2 >= hi1:  # disjoint spans: two walks
                k += -(-(e2 - s2) // n) if e2 > s2 else 0
            else:
                hi = max(hi1, e2)
                k = -(-(hi - lo1) // n) if hi > lo1 else 0
        walk.append(k + 1)  # + the blocks' own keys, one more tile
    order = (sp.pair_order if nb == 2 else sp.order).tolist()
    dq = [walk[j] for j in order]
    dq_pairs = (sum(walk) - len(walk)) * n * nb * B + len(walk) * (nb * B) ** 2
    return {"dkv": (dkv, context, dkv_pairs), "dq": (dq, context + own, dq_pairs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3_8b", choices=sorted(DRAFTERS))
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (H100/H200 SXM: 132)")
    ap.add_argument("--resident", type=int, default=1, help="programs an SM holds at once (dK/dV at 8B: 1)")
    ap.add_argument("--seeds", type=int, default=4)
    a = ap.parse_args()
    p = DRAFTERS[a.preset]
    print(f"{'row':>3} {'kernel':6} {'programs':>8} {'tiles':>7} {'longest':>7} {'spread, heads first':>19} "
          f"{'head by head':>12} {'pairs':>6}")
    for seed in range(a.seeds):
        for name, (places, allowed, computed) in programs(p, seed).items():
            first, by_head = (spread(dispatch(places, p["kv"], hf), a.sms, a.resident) for hf in (True, False))
            print(f"{seed:3d} {name:6} {len(places) * p['kv']:8d} {sum(places) * p['kv']:7d} {max(places):7d} "
                  f"{first:19.2f} {by_head:12.2f} {allowed / computed:6.2f}")


if __name__ == "__main__":
    main()
