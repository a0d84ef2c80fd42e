"""Hybrid and MoE targets at real sizes on one GPU, as the training job loads them (no target.* override):
attention chosen per architecture, the packing check, the compiled forward. Per target: load time,
the packing check's largest difference, first (compile) and steady forward times on a full packed
row, MFU from the layer-by-layer FLOPs (dflash_mp.flops), and compiled vs eager captures. `--attn`
compares attention implementations in one run (captures against the first one's); `--profile` adds
the GPU time of one forward per kernel class (matmul, attention, linear attention, ...).

    python bench/hybrid_targets.py [--targets builtin:random-qwen3.5-35b-a3b,...] [--steps 5]
        [--attn auto,sdpa,flex_attention] [--profile]
Random weights drawn on the GPU (no download). Writes $OUT/hybrid_targets.json (or bench/results).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from common import doc_lengths, kernel_profile, synthetic_batch  # noqa: E402

from dflash_mp.batch import PackedBatch  # noqa: E402
from dflash_mp.builtin import resolve_target_path  # noqa: E402
from dflash_mp.flops import causal_pairs_packed, target_layers_flops  # noqa: E402
from dflash_mp.target import TargetWorker, capture_layer_ids, load_target_config  # noqa: E402
from dflash_mp.target.packing import per_token_rel  # noqa: E402
from dflash_mp.target.spec import TargetConfig  # noqa: E402

TARGETS = "builtin:random-qwen3.5-27b,builtin:random-qwen3.5-35b-a3b,builtin:random-qwen3-30b-a3b"


def row(seq_len: int, vocab: int, seed: int) -> tuple[PackedBatch, list[int]]:
    hb = synthetic_batch(seq_len, 8, vocab, "cpu", torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lens = doc_lengths(seq_len, g, 256, 2048)
    return PackedBatch(hb.input_ids, hb.position_ids, hb.doc_ids, hb.loss_mask, len(lens), seq_len), lens


def ms(fn, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / steps


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Mean and max over tokens of the relative difference of two captures [T, H]."""
    rel = per_token_rel(a[None], b[None])
    return float(rel.mean()), float(rel.max())


def measure(name: str, path: str, cfg: dict, layer_ids: list[int], attn: str, a, dev) -> tuple[dict, torch.Tensor]:
    """One target loaded as the job loads it with `attn`: its figures, and its captures of the bench row."""
    t0 = time.perf_counter()
    worker = TargetWorker.load(path, layer_ids, dev, torch.bfloat16, attn_implementation=attn, compile=True,
                               probe_len=a.seq_len)  # defaults otherwise
    load_s = time.perf_counter() - t0
    diffs = worker.check_packing()
    pb, lens = row(a.seq_len, cfg["vocab_size"], 0)
    t0 = time.perf_counter()
    compiled = worker.forward(pb).hidden
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    fwd_ms = ms(lambda: worker.forward(pb), a.steps)
    eager = TargetWorker(worker.model, layer_ids, dev)
    want = eager.forward(pb).hidden
    eager_ms = ms(lambda: eager.forward(pb), 2)
    mean, worst = rel_diff(compiled, want)
    flops = target_layers_flops(cfg, range(max(layer_ids) + 1), a.seq_len, causal_pairs_packed(lens))
    r = dict(target=name, attn_implementation=attn, compiled_after_check=worker.compiled, layers=max(layer_ids) + 1,
             layer_ids=layer_ids, attention=worker.attention, linear_attention=worker.linear_how,
             load_s=round(load_s, 1), packing_check_max=max(diffs.values()), first_forward_s=round(first_s, 1),
             forward_ms=round(fwd_ms, 1), eager_forward_ms=round(eager_ms, 1),
             tflop_per_row=round(flops / 1e12, 1), mfu=round(flops / (fwd_ms / 1e3) / (a.peak_tflops * 1e12), 3),
             eager_mfu=round(flops / (eager_ms / 1e3) / (a.peak_tflops * 1e12), 3),
             compiled_vs_eager_max=worst, compiled_vs_eager_mean=mean,
             max_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
    if a.profile:
        r["profile"] = kernel_profile(lambda: worker.forward(pb), dev, n=2, top=20)
    return r, compiled  # the workers and the eager captures are freed with this frame


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default=TARGETS)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--attn", default="auto", help="target.attn_implementation values to compare")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    cache = os.environ.get("DFLASH_MP_CACHE", "/tmp/dflash_mp_cache")
    out_dir = os.environ.get("OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    results = []
    for name in a.targets.split(","):
        path = resolve_target_path(name, cache)
        cfg = load_target_config(path)
        layer_ids = capture_layer_ids(TargetConfig(num_capture=5 if cfg["num_hidden_layers"] > 40 else 3),
                                      cfg["num_hidden_layers"])
        first = None  # the first attention variant's captures, for the others to compare with
        for attn in a.attn.split(","):
            r, hidden = measure(name, path, cfg, layer_ids, attn, a, dev)
            if first is None:
                first = hidden
            else:
                r["vs_first_attn_mean"], r["vs_first_attn_max"] = rel_diff(hidden, first)
            print(json.dumps(r), flush=True)
            results.append(r)
            del hidden
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        del first
    with open(os.path.join(out_dir, "hybrid_targets.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("target | attention | compiled | linear attention | load s | check max | 1st fwd s | fwd ms | MFU | "
          "eager MFU | compiled vs eager max | vs first attention (mean)")
    for r in results:
        print(f"{r['target']} | {r['attention']} | {r['compiled_after_check']} | {r['linear_attention'][:30]} | "
              f"{r['load_s']} | {r['packing_check_max']:.1e} | {r['first_forward_s']} | {r['forward_ms']} | "
              f"{r['mfu']} | {r['eager_mfu']} | {r['compiled_vs_eager_max']:.1e} | {r.get('vs_first_attn_mean', '-')}")
        if "profile" in r:
            print("    ms per forward by kernel class:",
                  ", ".join(f"{k} {v:.1f}" for k, v in r["profile"]["ms_per_step_by_class"].items()))


if __name__ == "__main__":
    main()
