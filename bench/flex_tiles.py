"""flex_attention on the drafter's block mask at Qwen3-8B DFlash shapes: forward + backward time per
tile configuration (BlockMask block size and Inductor kernel options), one process, one mask; and
the Triton block kernels (`drafter.attention=triton`, variants `triton*`: their tiles) on the same row.
A Triton variant's name ending in `-ptr` loads the context key/value tiles through pointers
(block_attn.USE_TMA=False; without it, through tensor descriptors on sm_90+): `triton-ptr` is the
default tiles through pointers. A name ending in `-masked` (before any `-ptr`) masks every key tile
(block_attn.WHOLE_TILES=False; the default skips the mask on the tiles every row sees whole).

    python bench/flex_tiles.py [--variants bwd32,triton,triton-ptr,triton-n128,...]

One drafter layer's attention: q [1, 32, A*B, 128], k/v [1, 8, T + A*B, 128], bf16, the anchors
of a synthetic packed row. Times are per layer (the 8B drafter has five). Each variant's output
and gradients are compared with the first variant's (they compute the same thing).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from common import DRAFTERS, block_kernel_settings, median, synthetic_batch, timed, write_json
from dflash_mp.model import block_attn
from dflash_mp.model.anchors import sample_anchors
from dflash_mp.model.attention import make_mask_mod

DEFAULT_TILES = dict(block_attn.TILES)

# name -> (BlockMask block size (q, kv), kernel_options). Kernel tiles must divide the mask blocks.
BWD64 = {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64}


def bwd(m1: int, n1: int, m2: int, n2: int, warps: int = 4, stages: int = 3) -> dict:
    """Backward tiles: dK/dV walk query tiles of m1 rows per key tile of n1; dQ walks key tiles of n2
    per query tile of m2."""
    return {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
            "bwd_num_warps": warps, "bwd_num_stages": stages}


VARIANTS = {
    "inductor": ((128, 128), {}),  # Inductor's own tiles
    "rows-safe": ((128, 128), {"ROWS_GUARANTEED_SAFE": True}),
    "fwd128": ((128, 128), {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2}),
    "bwd64": ((128, 128), bwd(64, 64, 64, 64)),
    "bwd64w8": ((128, 128), bwd(64, 64, 64, 64, warps=8)),
    "bwd32": ((128, 128), bwd(32, 64, 64, 32)),  # dflash_mp's default (FLEX_KERNEL_OPTIONS)
    "bwd32s4": ((128, 128), bwd(32, 64, 64, 32, stages=4)),
    "bwd32s2": ((128, 128), bwd(32, 64, 64, 32, stages=2)),
    "bwd32w8": ((128, 128), bwd(32, 64, 64, 32, warps=8)),
    "bwd32n128": ((128, 128), bwd(32, 128, 128, 32)),
    "bwd32m128": ((128, 128), bwd(32, 64, 128, 32)),
    "bwd32x32": ((128, 128), bwd(32, 32, 32, 32)),
    "bwd16": ((128, 128), bwd(16, 64, 64, 16)),
    "mask128x64": ((128, 64), dict(BWD64, fwd_BLOCK_M=128, fwd_BLOCK_N=64)),
    "mask64": ((64, 64), dict(BWD64, fwd_BLOCK_M=64, fwd_BLOCK_N=64)),
    "autotune": ((128, 128), None),  # None: compiled with max-autotune (Inductor picks the tiles)
}
# name -> block_attn.TILES overrides (the Triton block kernels; "triton" is the default tiles). The
# `triton-first*` family is the first tiles (64-key dQ and dK/dV tiles, 4 warps, 2 backward stages) with
# one change each, the sweep that chose the defaults (BENCHMARKS.md, issue 31).
FIRST = {"BLOCK_N": 64, "DQ_BLOCK_N": 64, "BLOCK_N2": 64, "fwd_warps": 4, "fwd_stages": 3, "dq_warps": 4,
         "dq_stages": 2, "dkv_warps": 4, "dkv_stages": 2}
TRITON_VARIANTS = {
    "triton": {},
    "triton-first": FIRST,
    "triton-n128": dict(FIRST, BLOCK_N=128, DQ_BLOCK_N=128),  # forward and dQ over 128-key tiles
    "triton-n2x32": dict(FIRST, BLOCK_N2=32),
    "triton-n2x128": dict(FIRST, BLOCK_N2=128, dkv_warps=8),
    "triton-w8": dict(FIRST, fwd_warps=8, dq_warps=8, dkv_warps=8),
    "triton-s3": dict(FIRST, dq_stages=3, dkv_stages=3),
    "triton-dqw8": {"dq_warps": 8},
    "triton-dkvw4": {"dkv_warps": 4},
    "triton-n2x64": {"BLOCK_N2": 64, "dkv_warps": 4},  # dK/dV over 64-row tiles: fewer registers per program
    "triton-fwd128": {"BLOCK_N": 128, "fwd_warps": 8},
    "triton-fwds4": {"fwd_stages": 4},
    # Two consecutive blocks per program in the forward and dQ (block_attn's q_blocks): 128-row tiles at 8B shapes,
    # so 8 warps where the forward and dQ had 4, and dQ over 64-key tiles (three 128 x 128 fp32 tiles
    # would not fit in registers). triton-pairq is the default since it was measured (BENCHMARKS.md).
    # The previous default: one block per program, the forward and dQ with 4 warps, dQ over 128-key tiles.
    "triton-single": {"q_blocks": 1, "fwd_warps": 4, "dq_warps": 4, "DQ_BLOCK_N": 128, "dq_stages": 2},
    "triton-pairq": {"q_blocks": 2, "fwd_warps": 8, "dq_warps": 8, "DQ_BLOCK_N": 64, "dq_stages": 3},
    "triton-pairq-dq128": {"q_blocks": 2, "fwd_warps": 8, "dq_warps": 8},
    "triton-pairq-n128": {"q_blocks": 2, "fwd_warps": 8, "BLOCK_N": 128, "fwd_stages": 2, "dq_warps": 8,
                          "DQ_BLOCK_N": 64, "dq_stages": 3},
    "triton-pairq-s2": {"q_blocks": 2, "fwd_warps": 8, "dq_warps": 8, "DQ_BLOCK_N": 64, "dq_stages": 2},
    "triton-dq64w8": {"dq_warps": 8, "DQ_BLOCK_N": 64, "dq_stages": 3},  # pairq's dQ tiles, one block a program
    # dK/dV over 64-row tiles keeping 8 warps: 241 registers and no spill at 8B shapes, where the default
    # spills 48 B and triton-n2x64 (4 warps) 256 B (bench/kernel_resources.py); never timed.
    "triton-n2x64w8": {"BLOCK_N2": 64},
}


def triton_tiles(name: str) -> str | None:
    """The TRITON_VARIANTS entry of a Triton variant `name` (`-ptr` and `-masked` suffixes dropped); None for
    a flex one."""
    base = name.removesuffix("-ptr").removesuffix("-masked")
    return base if base in TRITON_VARIANTS else None


def triton_settings(name: str) -> dict:
    """common.block_kernel_settings' arguments for variant `name`: its TILES, the context tiles through
    pointers for a `-ptr` name and every tile masked for a `-masked` one; none for a flex variant."""
    if not triton_tiles(name):
        return {}
    return {"tiles": dict(DEFAULT_TILES, **TRITON_VARIANTS[triton_tiles(name)]),
            "use_tma": False if name.endswith("-ptr") else None,
            "whole_tiles": not name.removesuffix("-ptr").endswith("-masked")}


def triton_variant(name: str, anchors, valid, doc_ids, B: int, q, k, v, dout):
    """(fwd, fwd_bwd, result) of the block kernels, run under `triton_settings(name)` (the caller's)."""
    spans = block_attn.block_spans(anchors, valid, doc_ids, B, None)
    qq, kk, vv = (t[0].transpose(0, 1).contiguous().requires_grad_(True) for t in (q, k, v))  # [S, heads, D]
    do = dout[0].transpose(0, 1).contiguous()

    def fwd():
        return block_attn.block_attention(qq, kk, vv, spans)

    def fwd_bwd():
        fwd().backward(do)
        qq.grad = kk.grad = vv.grad = None

    def result():
        o = fwd()
        o.backward(do)
        return [x.transpose(0, 1)[None] for x in (o.detach(), qq.grad, kk.grad, vv.grad)]

    return fwd, fwd_bwd, result


def flex_variant(name: str, masks: dict, mask_mod, q_len: int, kv_len: int, q, k, v, dout, device):
    """(fwd, fwd_bwd, result, info) of flex_attention with the BlockMask size and kernel options `name`
    says (`masks`: the BlockMasks built so far, by size)."""
    size, opts = VARIANTS[name]
    if size not in masks:
        masks[size] = create_block_mask(mask_mod, None, None, q_len, kv_len, device=device, BLOCK_SIZE=size)
    bm = masks[size]
    mode = "max-autotune-no-cudagraphs" if opts is None else None
    fn = torch.compile(lambda q, k, v, bm=bm, o=opts or {}: flex_attention(
        q, k, v, block_mask=bm, enable_gqa=True, kernel_options=o), dynamic=False, mode=mode)
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

    def fwd():
        return fn(qq, kk, vv)

    def fwd_bwd():
        fwd().backward(dout)
        qq.grad = kk.grad = vv.grad = None

    def result():
        o = fwd()
        o.backward(dout)
        return [o.detach(), qq.grad, kk.grad, vv.grad]

    full = bm.full_kv_num_blocks.sum() if bm.full_kv_num_blocks is not None else 0
    return fwd, fwd_bwd, result, {"block_size": list(size), "kernel_options": opts,
                                  "tiles": int(bm.kv_num_blocks.sum() + full)}


def mask_mod_pairs(mask_mod, q_len: int, kv_len: int, device) -> int:
    """Visible (query, key) pairs of one head, counted in slices of queries."""
    total, kv = 0, torch.arange(kv_len, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    for s in range(0, q_len, 1024):
        qi = torch.arange(s, min(s + 1024, q_len), device=device)[:, None]
        total += int(mask_mod(zero, zero, qi, kv).sum())
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="inductor,bwd64,bwd32,bwd32s4,bwd32s2,bwd32w8,bwd32n128,bwd32m128,bwd32x32,bwd16")
    ap.add_argument("--preset", default="qwen3_8b", choices=sorted(DRAFTERS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=400, help="skip the remaining variants after this long")
    a = ap.parse_args()
    p = DRAFTERS[a.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    T, A, B, D = p["seq_len"], p["anchors"], p["block"], p["head_dim"]
    hb = synthetic_batch(T, 8, p["vocab"], device, torch.float32, seed=0)
    torch.manual_seed(0)
    anchors, valid = sample_anchors(hb.loss_mask, hb.doc_ids, A, A, noise=torch.rand(2, T, device=device))
    mask_mod = make_mask_mod(anchors, valid, hb.doc_ids, T, B, None)
    q_len, kv_len = A * B, T + A * B
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device).manual_seed(1)
    q = torch.randn(1, p["heads"], q_len, D, device=device, dtype=dt, generator=g)
    k = torch.randn(1, p["kv"], kv_len, D, device=device, dtype=dt, generator=g)
    v = torch.randn(1, p["kv"], kv_len, D, device=device, dtype=dt, generator=g)
    dout = torch.randn(1, p["heads"], q_len, D, device=device, dtype=dt, generator=g)
    masks, out, ref, t0 = {}, [], None, time.time()
    pairs = int(mask_mod_pairs(mask_mod, q_len, kv_len, device))
    fwd_flop = 4 * D * p["heads"] * pairs  # QK^T and PV over the visible pairs
    for name in a.variants.split(","):
        if time.time() - t0 > a.budget_s:
            out.append({"variant": name, "error": "skipped: over --budget-s"})
            continue
        try:
            with block_kernel_settings(**triton_settings(name)):
                if triton_tiles(name):
                    fwd, fwd_bwd, result = triton_variant(name, anchors, valid, hb.doc_ids, B, q, k, v, dout)
                    info = {"block_size": None, "kernel_options": TRITON_VARIANTS[triton_tiles(name)], "tiles": 0}
                else:
                    fwd, fwd_bwd, result, info = flex_variant(name, masks, mask_mod, q_len, kv_len, q, k, v, dout, device)
                tc = time.time()
                fwd_bwd()
                compile_s = time.time() - tc
                f_ms = median(timed(fwd, a.steps, device))
                fb_ms = median(timed(fwd_bwd, a.steps, device))
                res = result()
                diff = None
                if ref is None:
                    ref = res
                else:
                    diff = max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(res, ref))
                r = {"variant": name, **info, "fwd_ms": f_ms, "fwd_bwd_ms": fb_ms, "bwd_ms": fb_ms - f_ms,
                     "compile_s": round(compile_s, 1), "max_rel_diff_vs_first": diff, "fwd_tflops": fwd_flop / f_ms / 1e9}
        except Exception as e:  # one variant failing must not lose the others
            r = {"variant": name, "error": f"{type(e).__name__}: {e}"[:1000]}
        print(r, flush=True)
        out.append(r)
        write_json({"preset": a.preset, "torch": torch.__version__, "variants": out}, f"flex_tiles_{a.preset}.json")
    print(f"\nflex_attention, one drafter layer, {a.preset} (x{p['layers']} layers per step)")
    print(f"visible (query, key) pairs per head: {pairs:,}; forward {fwd_flop / 1e12:.3f} TFLOP per layer")
    print(f"{'variant':14} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'fwd TF/s':>8} {'tiles':>6} {'compile s':>9} {'rel diff':>9}")
    for r in out:
        if "error" in r:
            print(f"{r['variant']:14} {r['error'][:100]}")
            continue
        d = r["max_rel_diff_vs_first"]
        print(f"{r['variant']:14} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} {r['fwd_tflops']:8.0f} {r['tiles']:6d} "
              f"{r['compile_s']:9.1f} {'-' if d is None else f'{d:.1e}':>9}")


if __name__ == "__main__":
    sys.exit(main())
