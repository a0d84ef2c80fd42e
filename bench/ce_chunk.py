"""One chunk of the fused CE at Qwen3-8B shapes (rows x 4096 hidden against the 151936 x 4096
frozen LM head, bf16): the passes over the logits per loss kernel, and the Triton kernels' tiles.

    python bench/ce_chunk.py [--rows 4096] [--variants inductor,triton,triton-s8,...]

Each variant runs the whole chunk (logits GEMM, statistics, gradient, gradient GEMM); the two
GEMMs alone are timed too, so `passes_ms` = chunk - GEMMs is what the loss kernel costs. The
Triton variants' two passes are also timed alone (`stats_ms`, `grad_ms`), without the GEMMs'
noise, and the "triton passes alone" row repeats that at the defaults. Bytes are those of the
minimal passes: the statistics read the bf16 logits once, the gradient reads and writes them
once. Every variant's CE, argmax and gradient are compared with eager PyTorch's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import median, timed, write_json
from dflash_mp.model import ce_kernels
from dflash_mp.model.loss import _chunk_fn

# name -> (loss kernel, the ce_kernels settings it changes from their defaults). "triton": the
# defaults; "-lanes", "-lanes-tilemax", "-tiles": the statistics kernel (per-lane state, per-lane
# sums under one maximum per tile, or three reductions per tile, the previous default at its tiles);
# "-lanes-bN-wN": lanes (logits per iteration) and warps of the statistics pass; "-stN": tiles in
# flight per statistics program through shared memory; "-sN": statistics warps, "-gN": gradient
# warps, "-gtN": gradient tiles per program, "-bNk": the tiles of both passes.
VARIANTS = {
    "eager": ("eager", {}),
    "inductor": ("inductor", {}),
    "triton": ("triton", {}),
    "triton-lanes": ("triton", {"STATS": "lanes"}),
    "triton-lanes-tilemax": ("triton", {"STATS": "lanes-tilemax"}),
    "triton-tiles": ("triton", {"STATS": "tiles", "STATS_BLOCK": 4096, "STATS_WARPS": 4}),
    "triton-lanes-b512-w2": ("triton", {"STATS": "lanes", "STATS_BLOCK": 512, "STATS_WARPS": 2}),
    "triton-lanes-b2048-w4": ("triton", {"STATS": "lanes", "STATS_BLOCK": 2048, "STATS_WARPS": 4}),
    "triton-lanes-b2048-w8": ("triton", {"STATS": "lanes", "STATS_BLOCK": 2048, "STATS_WARPS": 8}),
    "triton-lanes-b4096-w8": ("triton", {"STATS": "lanes", "STATS_BLOCK": 4096, "STATS_WARPS": 8}),
    "triton-lanes-st2": ("triton", {"STATS": "lanes", "STATS_STAGES": 2}),
    "triton-lanes-st3": ("triton", {"STATS": "lanes", "STATS_STAGES": 3}),
    "triton-s16": ("triton", {"STATS_WARPS": 16}),
    "triton-s2": ("triton", {"STATS_WARPS": 2}),
    "triton-s8": ("triton", {"STATS_WARPS": 8}),
    "triton-g4": ("triton", {"GRAD_WARPS": 4}),
    "triton-gt2": ("triton", {"GRAD_TILES": 2}),
    "triton-gt4": ("triton", {"GRAD_TILES": 4}),
    "triton-b2k": ("triton", {"BLOCK_V": 2048, "STATS_BLOCK": 2048}),
    "triton-b8k": ("triton", {"BLOCK_V": 8192, "STATS_BLOCK": 8192}),
}
SETTINGS = ("STATS", "STATS_BLOCK", "STATS_WARPS", "STATS_STAGES", "BLOCK_V", "GRAD_WARPS", "GRAD_TILES")


def passes_alone(logits: torch.Tensor, y: torch.Tensor, steps: int, dev: torch.device) -> dict:
    """The statistics and the in-place gradient pass over `logits`, each timed alone."""
    logits_bytes = logits.numel() * logits.element_size()
    stats = median(timed(lambda: ce_kernels.ce_stats(logits, y), steps, dev))
    lse = ce_kernels.ce_stats(logits, y)[2]
    grad = median(timed(lambda: ce_kernels.softmax_grad_(logits, y, lse), steps, dev))
    return {"stats_ms": stats, "grad_ms": grad, "stats_tb_per_s": logits_bytes / stats / 1e9,
            "grad_tb_per_s": 2 * logits_bytes / grad / 1e9}


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
    defaults = {k: getattr(ce_kernels, k) for k in SETTINGS}
    rows = []
    for name in a.variants.split(","):
        kernel, settings = VARIANTS[name]
        for k, v in {**defaults, **settings}.items():
            setattr(ce_kernels, k, v)
        fn = _chunk_fn(kernel)
        for _ in range(3):
            out = fn(h, w, y, True)
        ms = median(timed(lambda fn=fn: fn(h, w, y, True), a.steps, dev))
        err = {"ce_max_abs": float((out[0] - ref[0]).abs().max()), "pred_equal": bool(torch.equal(out[1], ref[1])),
               "grad_rel": float((out[2].float() - ref[2].float()).norm() / ref[2].float().norm())}
        passes = ms - gemm_ms
        alone = passes_alone(F.linear(h, w), y, a.steps, dev) if kernel == "triton" else {}
        rows.append({"variant": name, "chunk_ms": ms, "gemm_ms": gemm_ms, "passes_ms": passes,
                     "minimal_tb_per_s": 3 * logits_bytes / passes / 1e9 if passes > 0 else None, **err, **alone})
        print(rows[-1], flush=True)
    for k, v in defaults.items():
        setattr(ce_kernels, k, v)
    if "triton" in a.variants.split(","):  # the two Triton passes alone, at the defaults
        rows.append({"variant": "triton passes alone", **passes_alone(F.linear(h, w), y, a.steps, dev)})
    write_json({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": a.rows, "vocab": vocab,
                "hidden": hidden, "results": rows}, "ce_chunk.json")
    print(f"\nCE chunk {a.rows} x {vocab} (GEMMs alone {gemm_ms:.3f} ms)")
    print(f"{'variant':22} {'chunk ms':>9} {'passes ms':>9} {'TB/s':>6} {'ce err':>8} {'argmax':>6} {'grad rel':>9}"
          f" {'stats ms':>9} {'TB/s':>6} {'grad ms':>8} {'TB/s':>6}")
    for r in rows:
        if "chunk_ms" in r:
            alone = (f" {r['stats_ms']:9.3f} {r['stats_tb_per_s']:6.2f} {r['grad_ms']:8.3f} {r['grad_tb_per_s']:6.2f}"
                     if "stats_ms" in r else "")
            print(f"{r['variant']:22} {r['chunk_ms']:9.3f} {r['passes_ms']:9.3f} {r['minimal_tb_per_s'] or 0:6.2f} "
                  f"{r['ce_max_abs']:8.1e} {str(r['pred_equal']):>6} {r['grad_rel']:9.1e}{alone}")
        else:
            print(f"triton alone: stats {r['stats_ms']:.3f} ms ({r['stats_tb_per_s']:.2f} TB/s), "
                  f"grad {r['grad_ms']:.3f} ms ({r['grad_tb_per_s']:.2f} TB/s)")


if __name__ == "__main__":
    main()
