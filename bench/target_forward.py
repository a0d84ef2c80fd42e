"""Target forward at Qwen3-8B shapes (random weights from the config, bf16, packed length 3072 with
document masks, capturing 5 layers): tokens/s and MFU per attention kernel / compile choice, and
what stopping after the last captured layer saves against a full forward with output_hidden_states.

    python bench/target_forward.py --variants full-flex,trunc-sdpa-dense,trunc-flex,trunc-flex-compiled
    python bench/target_forward.py --variants trunc-flex,trunc-flex-compiled,trunc-varlen,trunc-varlen-compiled
    python bench/target_forward.py --variants trunc-flex-compiled,trunc-triton,trunc-triton-compiled

`trunc-flex-compiled-ingraph` traces flex_attention into the compiled graph (Inductor then fuses the q/k
norm + RoPE into its kernel); `trunc-flex-compiled`, the GPU default, keeps it out (dflash_mp.target).
`trunc-varlen[-compiled]` run FlashAttention-2's varlen kernel on the row's documents (CUDA only),
always outside the compiled graph. `trunc-triton[-compiled]`: the Triton packed-document kernel
(target.attn_implementation=triton, the GPU default), inside the compiled layers; a suffix
`@mMnNwWsS` runs it with BLOCK_M=M, BLOCK_N=N, W warps, S stages instead of `doc_attn.TILES`.
`-ptr` (before any `@` suffix): the Triton kernel loads key/value tiles through pointers, not tensor
descriptors (doc_attn.USE_TMA). `-graph` (before any `@` suffix): the forward replayed as one CUDA graph (target.cuda_graph, the job's
default; TargetWorker's own default is off), e.g. `trunc-triton-compiled-graph`, the job's forward.
`-swiglu` (before `-graph`): the compiled layers' gate and up projections and the SwiGLU as one Triton
GEMM (swiglu.py), e.g. `trunc-triton-compiled-swiglu-graph`.
`-nodefer` (before `-graph`): compiled layers end with their own residual add instead of handing the
next layer (residual, delta) (TargetWorker's defer_residual), e.g. `trunc-triton-compiled-nodefer-graph`.
`-autotune` (before `-graph`): Inductor autotunes the layers' matmuls (max_autotune: cuBLAS against its
Triton templates, with pointwise work after a matmul, as the SwiGLU, fused into the epilogue where a
template wins; the pointwise configs stay untimed); `-autotune-tma` adds the persistent TMA matmul template
(triton.enable_persistent_tma_matmul), e.g. `trunc-triton-compiled-autotune-graph`. The first
forward's time (`warmup_ms[0]`) holds the autotuning. `-fold` (before `-graph`): the compiled layers'
RMSNorm weights folded into the projections that read the norms' outputs (TargetWorker's fold_norms,
target/fold.py; undone after the variant), e.g. `trunc-triton-compiled-fold-graph`; `-foldcheck` folds them as
a job's load does (TargetWorker.check_compiled, for good: run it last). `-lt` (before
`-graph`): the matmuls through cuBLASLt
(torch.backends.cuda.preferred_blas_library("cublaslt") while the variant runs; the default: cuBLAS).
Every truncated variant's captured hidden states are compared with the first truncated variant's, and
with `--compare-states FILE` with another process's (`--save-states FILE`; the weights are seeded).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys

import torch

from common import QWEN3_8B_TARGET, add_process_options, apply_process_options, blas_library, kernel_profile, median, synthetic_batch, timed, write_json
from dflash_mp.batch import PackedBatch
from dflash_mp.compile_stats import counts
from dflash_mp.flops import causal_pairs_packed, target_layers_flops
from dflash_mp.target import TargetWorker, doc_attn, default_layer_ids, doc_causal_block_mask, truncate

PEAK = 790e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="full-flex,trunc-sdpa-dense,trunc-flex,trunc-flex-compiled,"
                                          "trunc-flex-compiled-ingraph,trunc-varlen,trunc-varlen-compiled")
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test of this script")
    add_process_options(ap, "target")
    ap.add_argument("--save-states", default="", help="write the first truncated variant's captured states to "
                    "this file, for --compare-states in another process (e.g. another --cublas-workspace)")
    ap.add_argument("--compare-states", default="", help="compare every truncated variant's captured states with "
                    "this file's (--save-states of another process: the same seeded weights and row)")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3Config

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = apply_process_options(a, device, "target")
    c = dict(QWEN3_8B_TARGET)
    if a.tiny:
        c.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)  # the same weights in every process: --compare-states
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**c), dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    layer_ids = default_layer_ids(c["num_hidden_layers"], 5 if not a.tiny else 3)
    hb = synthetic_batch(a.seq_len, 8, c["vocab_size"], "cpu", dtype, seed=0)
    pb = PackedBatch(hb.input_ids, hb.position_ids, hb.doc_ids, hb.loss_mask, int(hb.doc_ids.max()) + 1, a.seq_len)
    lens = torch.bincount(pb.doc_ids).tolist()
    pairs = causal_pairs_packed(lens)

    def flops(layers: int, head: bool) -> float:
        f = target_layers_flops(c, range(layers), a.seq_len, pairs)
        return f + (2 * a.seq_len * c["hidden_size"] * c["vocab_size"] if head else 0)

    res = {"seq_len": a.seq_len, "doc_lengths": lens, "layer_ids": layer_ids, "torch": torch.__version__,
           **options,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "variants": []}
    ids, pos, docs = (t.to(device) for t in (pb.input_ids, pb.position_ids, pb.doc_ids))
    variants = a.variants.split(",")
    if any(re.search(r"-foldcheck(-|@|$)", v) for v in variants[:-1]):
        ap.error("a -foldcheck variant folds the model's norms for good: it must be the last variant")
    truncated = False
    first = None  # (variant, captured hidden states) of the first truncated variant: the others must match it
    saved = torch.load(a.compare_states).to(device).float() if a.compare_states else None  # another process's
    default_tiles = dict(doc_attn.TILES)
    for v in variants:
        lt = contextlib.ExitStack()  # after the variant: PyTorch's BLAS library (`-lt`), the norms unfolded
        check = {}  # what the load's check found (`-foldcheck`)
        try:
            tiles = re.fullmatch(r".*@m(\d+)n(\d+)w(\d+)s(\d+)", v)
            if tiles:  # the Triton kernel's tiles for this variant (kept while it runs: read at each forward)
                doc_attn.TILES[c["head_dim"]] = tuple(int(x) for x in tiles.groups())
            if re.search(r"-ptr(-|@|$)", v):
                doc_attn.USE_TMA = False
            if v.startswith("full"):
                assert not truncated, "full-* variants must come before trunc-* ones"
                model.config._attn_implementation = "flex_attention"
                mask = doc_causal_block_mask(docs)

                @torch.inference_mode()
                def fn():
                    out = model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask,
                                output_hidden_states=True, use_cache=False)
                    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)

                f = flops(c["num_hidden_layers"], True)
            else:
                if not truncated:
                    truncate(model, max(layer_ids))
                    truncated = True
                attn = ("sdpa" if "sdpa" in v else "varlen" if "varlen" in v else "triton" if "triton" in v
                        else "flex_attention")
                model.config._attn_implementation = attn
                graphed = re.search(r"-graph(@|$)", v) is not None
                tune = re.search(r"-autotune(-tma)?(-|@|$)", v)
                if re.search(r"-lt(-|@|$)", v):
                    lt.enter_context(blas_library("cublaslt", device))
                options = None if not tune else {"max_autotune": True, **(
                    {"triton.enable_persistent_tma_matmul": True} if tune.group(1) else {})}
                worker = TargetWorker(model, layer_ids, device, compile="compiled" in v,
                                      flex_in_graph=v.endswith("ingraph"), cuda_graph=graphed,
                                      defer_residual="-nodefer" not in v, compile_options=options,
                                      fused_swiglu=re.search(r"-swiglu(-|@|$)", v) is not None,
                                      fold_norms=re.search(r"-foldcheck(-|@|$)", v) is not None)
                if worker.fold_norms:  # the load's check folds the layers (for good: run such a variant last)
                    check = {"check_rel": worker.check_compiled(a.seq_len), "folded": len(worker.folded),
                             "fold_diff": worker.fold_diff}
                if re.search(r"-fold(-|@|$)", v):
                    if not worker.deferred:
                        raise ValueError(f"{v}: -fold folds compiled deferred layers only")
                    lt.callback(lambda folds=worker.fold_layers(): [f.undo() for f in folds])
                if graphed and worker.graph is None:
                    raise ValueError(f"{v}: no CUDA graph here ({worker.graph_why})")
                fn = lambda: worker.forward(pb)  # noqa: E731
                f = flops(max(layer_ids) + 1, False)
            warm = timed(fn, 3, device)
            c0 = counts()
            ms = timed(fn, a.steps, device)
            # As a job's target runs them: forwards back to back, one sync at the end (the GPU stays busy,
            # its clocks where a sustained load puts them).
            b2b = timed(lambda: [fn() for _ in range(a.steps)], 1, device)[0] / a.steps
            c1 = counts()
            med = median(ms)
            r = {"variant": v, "ms": med, "tokens_per_s": a.seq_len * 1000 / med, "tflop": f / 1e12,
                 "mfu": f / (med / 1000) / PEAK, "ms_each": ms, "ms_back_to_back": b2b, "warmup_ms": warm,
                 "recompiles": c1["graphs"] - c0["graphs"], **check}
            if not v.startswith("full"):
                h = fn().hidden.float()
                if first is None:
                    first = (v, h)
                    if a.save_states:
                        torch.save(h.cpu(), a.save_states)
                else:  # same model, same batch: only kernels and fusion differ
                    r[f"rel_diff_vs_{first[0]}"] = float((h - first[1]).abs().max() / first[1].abs().max())
                if saved is not None:
                    r["rel_diff_vs_saved_states"] = float((h - saved).abs().max() / saved.abs().max())
            if device.type == "cuda":  # where the time goes (after the timed runs, so it cannot skew them)
                r["profile"] = kernel_profile(fn, device, top=15)
        except Exception as e:
            r = {"variant": v, "error": f"{type(e).__name__}: {e}"[:2000]}
        finally:
            lt.close()
            doc_attn.TILES.clear()
            doc_attn.TILES.update(default_tiles)
            doc_attn.USE_TMA = None
        res["variants"].append(r)
        print(r, flush=True)
        write_json(res, "target_qwen3_8b.json" if not a.tiny else "target_tiny.json")
    print(f"\ntarget forward, T={a.seq_len}, docs {lens}, layers {layer_ids} on {res['device']}")
    print(f"{'variant':28} {'ms':>8} {'b2b ms':>8} {'tok/s':>10} {'TFLOP':>7} {'MFU':>6} {'recomp':>6} "
          f"{'max rel diff':>12}")
    for r in res["variants"]:
        if "error" in r:
            print(f"{r['variant']:28} ERROR {r['error'][:120]}")
        else:
            diff = next((f"{x:12.2e}" for k, x in r.items() if k.startswith("rel_diff")), f"{'':12}")
            print(f"{r['variant']:28} {r['ms']:8.2f} {r['ms_back_to_back']:8.2f} {r['tokens_per_s']:10.0f} "
                  f"{r['tflop']:7.2f} {r['mfu']:6.3f} "
                  f"{r['recompiles']:6d} {diff}")
    for r in res["variants"]:
        if "rel_diff_vs_saved_states" in r:
            print(f"{r['variant']}: captured states against {a.compare_states}: max relative difference "
                  f"{r['rel_diff_vs_saved_states']:.2e}")
    for r in res["variants"]:
        if r.get("profile"):
            cls = ", ".join(f"{k} {v:.1f}" for k, v in r["profile"]["ms_per_step_by_class"].items())
            print(f"{r['variant']} GPU ms by kernel class: {cls}")


if __name__ == "__main__":
    sys.exit(main())
