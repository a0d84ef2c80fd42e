"""One target layer's packed-document attention at Qwen3-8B shapes: flex_attention (as transformers runs
it) against the Triton kernel (target.attn_implementation=triton) per tile choice, in one process.

    python bench/doc_attn_tiles.py [--variants flex,triton,triton-m128n128w8s2,...] [--seq-len 3072]

q [3072, 32, 128], k/v [3072, 8, 128], bf16, the documents of target_forward.py's row (same seed).
`triton-mMnNwWsS`: BLOCK_M=M query rows, BLOCK_N=N keys (N divides M), W warps, S stages; a last `-ptr` or
`-tma` loads the key/value tiles through pointers or tensor descriptors (default: descriptors on sm_90+).
`cudnn`: cuDNN's fused attention over the row's documents as ragged sequences (aten._cudnn_attention_forward
with cumulative lengths), GQA as it is; `cudnn-bN` pads the sequence list to N with empty sequences (a fixed
shape for a CUDA graph, whatever the row holds); `-rep` repeats K/V to every query head; `-graph` times
replays of a captured CUDA graph of the call. `varlen`: FlashAttention-2's varlen kernel (aten).
`--docs 300x10,72`: the row's document lengths instead of the synthetic row's. ms is GPU kernel time per
call (profiler); wall_ms, the host's time per call, is launch-bound at this size. TFLOP/s counts the
visible (query, key) pairs only: 4 * D * pairs * heads. Every variant's output is compared with the first's.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

from common import QWEN3_8B_TARGET, kernel_profile, median, synthetic_batch, timed, write_json
from dflash_mp.flops import causal_pairs_packed
from dflash_mp.target import doc_attn
from dflash_mp.target.attention import doc_causal_block_mask

DEFAULT = ("flex,triton,triton-ptr,triton-m64n128w4s2,triton-m64n128w4s2-ptr,triton-m128n128w8s2,triton-m64n64w4s3,triton-m64n64w8s2,triton-m128n64w8s3,triton-m128n128w8s2,"
           "triton-m128n64w4s3,triton-m32n32w4s2")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=DEFAULT)
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--docs", default="", help="document lengths, e.g. 300x10,72 (they must sum to --seq-len)")
    ap.add_argument("--json", default="doc_attn_tiles.json")
    a = ap.parse_args()
    device = torch.device("cuda")
    c = QWEN3_8B_TARGET
    T, hq, hkv, d = a.seq_len, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    if a.docs:
        lens = [int(n) for part in a.docs.split(",") for n in
                ([part.split("x")[0]] * int(part.split("x")[1]) if "x" in part else [part])]
        if sum(lens) != T:
            raise SystemExit(f"--docs {a.docs}: the lengths sum to {sum(lens)}, not --seq-len {T}")
        docs = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    else:
        docs = synthetic_batch(T, 8, 1000, "cpu", torch.bfloat16, seed=0).doc_ids
        lens = torch.bincount(docs).tolist()
    flop = 4 * d * causal_pairs_packed(lens) * hq
    docs = docs.to(device)
    g = torch.Generator(device).manual_seed(0)
    # transformers' layout: [1, H, T, D] views of [1, T, H, D] projections.
    q, k, v = (torch.randn(1, T, h, d, generator=g, device=device, dtype=torch.bfloat16).transpose(1, 2)
               for h in (hq, hkv, hkv))
    default_tiles = doc_attn.TILES[d]
    res = {"seq_len": T, "doc_lengths": lens, "tflop": flop / 1e12, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "default_tiles": default_tiles, "variants": []}
    first = None
    for name in a.variants.split(","):
        try:
            if name == "flex":
                from torch.nn.attention.flex_attention import flex_attention

                mask = doc_causal_block_mask(docs)
                flex = torch.compile(flex_attention, dynamic=False)
                fn = lambda: flex(q, k, v, block_mask=mask, enable_gqa=True).transpose(1, 2)  # noqa: E731
            elif name.startswith(("cudnn", "varlen")):
                fn = ragged_call(name, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), lens)
            else:
                m = re.fullmatch(r"triton(?:-m(\d+)n(\d+)w(\d+)s(\d+))?(-ptr|-tma)?", name)
                if m is None:
                    raise ValueError(f"unknown variant {name!r}")
                doc_attn.TILES[d] = tuple(int(x) for x in m.groups()[:4]) if m.group(1) else default_tiles
                doc_attn.USE_TMA = {"-ptr": False, "-tma": True}.get(m.group(5))
                rows = doc_attn.doc_rows(docs, d)
                fn = lambda: doc_attn.doc_attention(q[0].transpose(0, 1), k[0].transpose(0, 1),  # noqa: E731
                                                    v[0].transpose(0, 1), rows)[None]
            timed(fn, 3, device)
            wall = median(timed(fn, a.steps, device))
            # Kernel time from the profiler: one call is ~0.2 ms, so wall time is partly the host's launch.
            prof = kernel_profile(fn, device, n=a.steps, top=3)
            ms = sum(prof["ms_per_step_by_class"].values())
            out = fn().float()
            r = {"variant": name, "ms": ms, "wall_ms": wall, "tflop_per_s": flop / (ms / 1000) / 1e12}
            if name.startswith("triton"):
                r["tiles"] = doc_attn.TILES[d]
            r["kernels"] = prof["top_kernels"]
            if first is None:
                first = (name, out)
            else:
                r[f"max_rel_diff_vs_{first[0]}"] = float((out - first[1]).abs().max() / first[1].abs().max())
        except Exception as e:
            r = {"variant": name, "error": f"{type(e).__name__}: {e}"[:1500]}
        finally:
            doc_attn.TILES[d] = default_tiles
            doc_attn.USE_TMA = None
        res["variants"].append(r)
        print(r, flush=True)
        write_json(res, a.json)
    print(f"\ntarget attention, one layer, T={T}, docs {lens}, {flop / 1e12:.3f} TFLOP on {res['device']}")
    print(f"{'variant':24} {'GPU ms':>8} {'wall ms':>8} {'TFLOP/s':>8} {'max rel diff':>12}")
    for r in res["variants"]:
        if "error" in r:
            print(f"{r['variant']:24} ERROR {r['error'][:120]}")
        else:
            diff = next((f"{x:12.2e}" for k, x in r.items() if k.startswith("max_rel")), f"{'':12}")
            print(f"{r['variant']:24} {r['ms']:8.3f} {r['wall_ms']:8.3f} {r['tflop_per_s']:8.1f} {diff}")


def ragged_call(name: str, q, k, v, lens: list[int]):
    """A no-argument call of cuDNN's or FlashAttention-2's attention over the documents `lens` of q
    `[T, Hq, D]`, k/v `[T, Hkv, D]`, returning `[1, T, Hq, D]` (see the module doc for the variants)."""
    m = re.fullmatch(r"(cudnn|varlen)(?:-b(\d+))?(-rep)?(-graph)?", name)
    if m is None:
        raise ValueError(f"unknown variant {name!r}")
    kind, pad, rep, graph = m.group(1), m.group(2), m.group(3), m.group(4)
    T, d = q.shape[0], q.shape[-1]
    n = int(pad) if pad else len(lens)
    if n < len(lens):
        raise ValueError(f"{name}: {len(lens)} documents do not fit {n} sequences")
    cum = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    cum = torch.cat([cum, cum[-1:].expand(n - len(lens))]).to(torch.int32).to(q.device)
    if rep:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    q, k, v = (x.contiguous() for x in (q, k, v))
    longest = T if pad else max(lens)
    scale = d ** -0.5
    if kind == "cudnn":
        call = lambda: torch.ops.aten._cudnn_attention_forward(  # noqa: E731
            q, k, v, None, cum, cum, longest, longest, False, 0.0, True, False, scale=scale)[0]
    else:
        call = lambda: torch.ops.aten._flash_attention_forward(  # noqa: E731
            q, k, v, cum, cum, longest, longest, 0.0, True, False, scale=scale)[0]
    if not graph:
        return lambda: call()[None]
    out = call()  # warm-up (plan built) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    expect = call().clone()
    g.replay()
    torch.cuda.synchronize()
    if not torch.equal(out, expect):
        raise RuntimeError(f"{name}: the replayed graph's output differs from an eager call's "
                           f"(max {float((out.float() - expect.float()).abs().max()):.3e})")

    def replay():
        g.replay()
        return out[None]
    return replay


if __name__ == "__main__":
    sys.exit(main())
