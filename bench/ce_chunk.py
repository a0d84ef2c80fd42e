"""One chunk of the fused CE at Qwen3-8B shapes (rows x 4096 hidden against the 151936 x 4096
frozen LM head, bf16): the passes over the logits per loss kernel, and the Triton kernels' tiles.

    python bench/ce_chunk.py [--rows 4096] [--variants inductor,triton,triton-s8,...]

Each variant runs the whole chunk (logits GEMM, statistics, gradient, gradient GEMM); the two
GEMMs alone are timed too, so `passes_ms` = chunk - GEMMs is what the loss kernel costs. Bytes
are those of the minimal passes: the statistics read the bf16 logits once, the gradient reads
and writes them once. Every variant's CE, argmax and gradient are compared with eager PyTorch's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import median, timed, write_json
from dflash_mp.model import ce_kernels
from dflash_mp.model.loss import _chunk_fn

# name -> (loss kernel, Triton settings: BLOCK_V, STATS_WARPS, GRAD_WARPS)
VARIANTS = {
    "eager": ("eager", None),
    "inductor": ("inductor", None),
    "triton": ("triton", (4096, 4, 8)),  # the defaults of dflash_mp.model.ce_kernels
    "triton-s16": ("triton", (4096, 16, 8)),
    "triton-s2": ("triton", (4096, 2, 8)),
    "triton-s8": ("triton", (4096, 8, 8)),
    "triton-g4": ("triton", (4096, 4, 4)),
    "triton-b2k": ("triton", (2048, 4, 8)),
    "triton-b8k": ("triton", (8192, 4, 8)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    vocab, hidden = 151936, 4096
    h = (torch.randn(a.rows, hidden, generator=g, device=dev)).bfloat16()
    w = (torch.randn(vocab, hidden, generator=g, device=dev) * 0.02).bfloat16()
    y = torch.randint(0, vocab, (a.rows,), generator=g, device=dev)
    logits_bytes = a.rows * vocab * 2

    def gemms():
        logits = F.linear(h, w)
        return logits @ w

    gemm_ms = median(timed(gemms, a.steps, dev))
    ref = _chunk_fn("eager")(h, w, y, True)
    defaults = (ce_kernels.BLOCK_V, ce_kernels.STATS_WARPS, ce_kernels.GRAD_WARPS)
    rows = []
    for name in a.variants.split(","):
        kernel, tiles = VARIANTS[name]
        ce_kernels.BLOCK_V, ce_kernels.STATS_WARPS, ce_kernels.GRAD_WARPS = tiles or defaults
        fn = _chunk_fn(kernel)
        for _ in range(3):
            out = fn(h, w, y, True)
        ms = median(timed(lambda fn=fn: fn(h, w, y, True), a.steps, dev))
        err = {"ce_max_abs": float((out[0] - ref[0]).abs().max()), "pred_equal": bool(torch.equal(out[1], ref[1])),
               "grad_rel": float((out[2].float() - ref[2].float()).norm() / ref[2].float().norm())}
        passes = ms - gemm_ms
        rows.append({"variant": name, "chunk_ms": ms, "gemm_ms": gemm_ms, "passes_ms": passes,
                     "minimal_tb_per_s": 3 * logits_bytes / passes / 1e9 if passes > 0 else None, **err})
        print(rows[-1], flush=True)
    ce_kernels.BLOCK_V, ce_kernels.STATS_WARPS, ce_kernels.GRAD_WARPS = defaults
    if "triton" in a.variants.split(","):  # the two Triton passes alone, at the defaults
        logits = F.linear(h, w)
        stats = median(timed(lambda: ce_kernels.ce_stats(logits, y), a.steps, dev))
        lse = ce_kernels.ce_stats(logits, y)[2]
        grad = median(timed(lambda: ce_kernels.softmax_grad_(logits, y, lse), a.steps, dev))
        rows.append({"variant": "triton passes alone", "stats_ms": stats, "grad_ms": grad,
                     "stats_tb_per_s": logits_bytes / stats / 1e9, "grad_tb_per_s": 2 * logits_bytes / grad / 1e9})
    write_json({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": a.rows, "vocab": vocab,
                "hidden": hidden, "results": rows}, "ce_chunk.json")
    print(f"\nCE chunk {a.rows} x {vocab} (GEMMs alone {gemm_ms:.3f} ms)")
    print(f"{'variant':14} {'chunk ms':>9} {'passes ms':>9} {'TB/s':>6} {'ce err':>8} {'argmax':>6} {'grad rel':>9}")
    for r in rows:
        if "chunk_ms" in r:
            print(f"{r['variant']:14} {r['chunk_ms']:9.3f} {r['passes_ms']:9.3f} {r['minimal_tb_per_s'] or 0:6.2f} "
                  f"{r['ce_max_abs']:8.1e} {str(r['pred_equal']):>6} {r['grad_rel']:9.1e}")
        else:
            print(f"triton alone: stats {r['stats_ms']:.3f} ms ({r['stats_tb_per_s']:.2f} TB/s), "
                  f"grad {r['grad_ms']:.3f} ms ({r['grad_tb_per_s']:.2f} TB/s)")


if __name__ == "__main__":
    main()
