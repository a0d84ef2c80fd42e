"""Hybrid and MoE targets at real sizes on one GPU, as the training job loads them (no target.* override):
attention chosen per architecture, the packing check, the compiled forward. Per target: load time,
the packing check's largest difference, first (compile) and steady forward times on a full packed
row, MFU from the layer-by-layer FLOPs (dflash_mp.flops), and compiled vs eager captures.

    python bench/hybrid_targets.py [--targets builtin:random-qwen3.5-35b-a3b,...] [--steps 5]
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
from common import doc_lengths, synthetic_batch  # noqa: E402

from dflash_mp.batch import PackedBatch  # noqa: E402
from dflash_mp.builtin import resolve_target_path  # noqa: E402
from dflash_mp.flops import causal_pairs_packed, target_layers_flops  # noqa: E402
from dflash_mp.target import TargetWorker, capture_layer_ids, load_target_config  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default=TARGETS)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
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
        t0 = time.perf_counter()
        worker = TargetWorker.load(path, layer_ids, dev, torch.bfloat16, compile=True,  # defaults otherwise
                                   probe_len=a.seq_len)
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
        rel = ((compiled.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-12))
        flops = target_layers_flops(cfg, range(max(layer_ids) + 1), a.seq_len, causal_pairs_packed(lens))
        r = dict(target=name, compiled_after_check=worker.compiled, layers=max(layer_ids) + 1, layer_ids=layer_ids, attention=worker.attention,
                 linear_attention=worker.linear_how, load_s=round(load_s, 1),
                 packing_check_max=max(diffs.values()), first_forward_s=round(first_s, 1),
                 forward_ms=round(fwd_ms, 1), eager_forward_ms=round(eager_ms, 1),
                 tflop_per_row=round(flops / 1e12, 1), mfu=round(flops / (fwd_ms / 1e3) / (a.peak_tflops * 1e12), 3),
                 eager_mfu=round(flops / (eager_ms / 1e3) / (a.peak_tflops * 1e12), 3),
                 compiled_vs_eager_max=float(rel.max()), compiled_vs_eager_mean=float(rel.mean()),
                 max_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
        print(json.dumps(r), flush=True)
        results.append(r)
        del worker, eager, compiled, want
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with open(os.path.join(out_dir, "hybrid_targets.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("target | attention | linear attention | load s | check max | 1st fwd s | fwd ms | MFU | eager MFU | "
          "compiled vs eager max")
    for r in results:
        print(f"{r['target']} | {r['attention']} | {r['linear_attention'][:30]} | {r['load_s']} | "
              f"{r['packing_check_max']:.1e} | {r['first_forward_s']} | {r['forward_ms']} | {r['mfu']} | "
              f"{r['eager_mfu']} | {r['compiled_vs_eager_max']:.1e}")


if __name__ == "__main__":
    main()
