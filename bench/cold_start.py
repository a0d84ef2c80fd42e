"""Where a cold node's start-up goes, and what a restart from saved compile artifacts still compiles.

    python bench/cold_start.py masks --builders ours,torch   # BlockMask builders at the job's shapes
    python bench/cold_start.py step --preset qwen3_5_27b --save ART   # a cold drafter: 3 timed steps
    python bench/cold_start.py step --preset qwen3_5_27b --load ART   # the same from the artifacts

`masks`: `build_block_mask` (ours) against `torch.compile(create_block_mask)` (torch) for the drafter's
full and sliding masks (T=3072, 512 blocks of 16) and the target's packed-document mask: the first
call (compile included) and the per-call time after it, and whether both give the same BlockMask.
`step`: the drafter's production step (compile default, layers scope, Triton CE, bf16, overlapped
update) from whatever caches the environment points at; the seconds of its phases, Inductor's and
AOTAutograd's cache counters, and with bench/triton_timer on PYTHONPATH the slowest Triton compiles.
Each prints one JSON line (also written under $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from common import DRAFTERS, synthetic_batch, write_json


def now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def drafter_masks(p: dict, device, seed: int):
    """The drafter's mask_mods for one batch: anchors drawn inside documents, as the objective does."""
    from dflash_mp.model.attention import make_mask_mod

    hb = synthetic_batch(p["seq_len"], 8, 1000, device, torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randperm(p["seq_len"] - 1, generator=g)[: p["anchors"]] + 1).values.to(device)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    T, B = p["seq_len"], p["block"]
    mods = {"drafter full": make_mask_mod(anchors, valid, hb.doc_ids, T, B, None)}
    if p.get("window"):
        mods["drafter sliding"] = make_mask_mod(anchors, valid, hb.doc_ids, T, B, p["window"])
    return mods, T, p["anchors"] * B, hb.doc_ids


def target_mask_mod(doc_ids):
    def mask_mod(b, h, q, kv):
        return (doc_ids[q] == doc_ids[kv]) & (kv <= q)

    return mask_mod


def run_masks(a, device) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash_mp.block_mask import build_block_mask

    p = DRAFTERS[a.preset]
    torch_cbm = torch.compile(create_block_mask, dynamic=False)

    def build(builder, mod, q, kv):
        if builder == "ours":
            return build_block_mask(mod, q, kv, device, 128)
        return torch_cbm(mod, None, None, q, kv, device=device, BLOCK_SIZE=128)

    out = {"preset": a.preset, "device": str(device), "torch": torch.__version__, "rows": []}
    for builder in a.builders.split(","):
        for kind in ("drafter full", "drafter sliding", "target"):
            def mod_for(seed):
                mods, T, Q, docs = drafter_masks(p, device, seed)
                if kind == "target":
                    return target_mask_mod(docs), T, T
                return mods.get(kind), Q, T + Q

            mod, q, kv = mod_for(0)
            if mod is None:
                continue
            t = now(device)
            first = build(builder, mod, q, kv)
            first_s = now(device) - t
            times = []
            for seed in range(1, 11):
                mod_s, _, _ = mod_for(seed)
                t = now(device)
                build(builder, mod_s, q, kv)
                times.append(1000 * (now(device) - t))
            row = {"builder": builder, "mask": kind, "q": q, "kv": kv, "first_call_s": round(first_s, 2),
                   "ms_per_call": round(sorted(times)[len(times) // 2], 3)}
            if builder != "ours":  # the same BlockMask as ours, field by field
                ours = build_block_mask(mod, q, kv, device, 128)
                row["same_as_ours"] = all(torch.equal(getattr(first, f), getattr(ours, f)) for f in (
                    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                    "q_indices", "full_q_num_blocks", "full_q_indices"))
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    return out


def triton_compiles(path: str | None, since: float) -> dict:
    """The Triton compile log of bench/triton_timer: count, summed seconds, the slowest names."""
    if not path or not os.path.exists(path):
        return {}
    rows = [json.loads(line) for line in open(path) if line.strip()]
    rows = [r for r in rows if r["t"] >= since]
    slow = sorted(rows, key=lambda r: -r["s"])
    return {"count": len(rows), "seconds_summed": round(sum(r["s"] for r in rows), 1),
            "over_1s": sum(r["s"] > 1 for r in rows), "processes": len({r["pid"] for r in rows}),
            "slowest": [(r["name"], r["s"]) for r in slow[:12]]}


def in_ring_slot(hb, slot: int, depth: int = 4):
    """`hb` copied into slot `slot % depth` of a transport ring (transport.base.carve_slots)."""
    from dflash_mp.transport.base import SlotSpec, carve_slots

    T, D = hb.hidden.shape
    spec = SlotSpec(seq_len=T, hidden_dim=D, hidden_dtype=hb.hidden.dtype, device=hb.hidden.device)
    s = carve_slots(torch.zeros(depth * spec.slot_bytes, dtype=torch.uint8, device=hb.hidden.device), spec,
                    depth)[slot % depth]
    s.hidden.copy_(hb.hidden)
    for name, t in s.fields.items():
        t.copy_(getattr(hb, name))
    return s.batch(slot, hb.num_valid_tokens, 0)


def run_step(a, device) -> dict:
    from drafter_step import build, compile_seconds

    from dflash_mp import compile_cache
    from dflash_mp.compile_stats import cache_counts
    from dflash_mp.model import drafter as drafter_mod

    started = time.time()
    loaded = compile_cache.load(a.load) if a.load else False
    p = DRAFTERS[a.preset]
    mask_s = []
    inner = drafter_mod.build_block_attention

    def timed_masks(*args, **kwargs):  # the first step's mask build, compile included
        t = now(device)
        out = inner(*args, **kwargs)
        mask_s.append(now(device) - t)
        return out

    drafter_mod.build_block_attention = timed_masks
    t = time.perf_counter()
    mode = "default+ce=triton" if device.type == "cuda" else "default"  # the job's defaults (no Triton on CPU)
    tr = build(p, mode, device, p.get("chunk", 4096), scope="layers")
    build_s = time.perf_counter() - t
    batches = [synthetic_batch(p["seq_len"], p["k"] * p["hidden"], p["vocab"], device, torch.bfloat16, seed=s)
               for s in range(2)]
    if a.slot is not None:  # as the transport hands them out: views into ring slot `a.slot`, `a.slot + 1`
        batches = [in_ring_slot(hb, a.slot + i) for i, hb in enumerate(batches)]
    steps = []
    for i in range(a.steps):
        t = now(device)
        tr.train_step(batches[i % 2])
        tr.opt.wait_all()
        steps.append(round(now(device) - t, 2))
    out = {"preset": a.preset, "loaded_artifacts": loaded, "build_s": round(build_s, 1), "step_s": steps,
           "first_mask_build_s": round(mask_s[0], 2) if mask_s else None, "caches": cache_counts(),
           "compile_phases_s": compile_seconds(), "triton": triton_compiles(os.environ.get("DFLASH_TRITON_LOG"), started)}
    if a.save:
        out["saved"] = compile_cache.save(a.save)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["masks", "step"])
    ap.add_argument("--preset", default="qwen3_5_27b", choices=sorted(DRAFTERS))
    ap.add_argument("--builders", default="ours,torch", help="masks: ours and/or torch, in this order")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--save", default=None, help="step: write the compile artifacts here afterwards")
    ap.add_argument("--load", default=None, help="step: load compile artifacts from here first")
    ap.add_argument("--tag", default="", help="name of the JSON file's variant")
    ap.add_argument("--slot", type=int, default=None, help="step: feed the batches as views into this ring slot")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = run_masks(a, device) if a.what == "masks" else run_step(a, device)
    print(json.dumps(out), flush=True)
    write_json(out, f"cold_{a.what}_{a.preset}{a.tag}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
