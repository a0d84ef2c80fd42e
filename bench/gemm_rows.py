"""How fast cuBLAS runs a dense target's layer GEMMs (Qwen3-8B's by default) at the row counts a
forward could give them.

The target forward runs one packed row (T = 3072 tokens) at a time, and its matmuls ran at ~0.90 of
the 790 TFLOP/s ceiling where the drafter's (8,192 block tokens) ran at ~0.95. This times one
layer's GEMMs (`torch.nn.functional.linear`, bf16, the weights' `[out, in]` layout) at M = 3072 (one
row), 6144 (two rows a forward) and 8192, and beside them q/k/v and gate/up as single GEMMs, so the
gain of more rows a forward (or of fused projections) is known before it is built:

    python bench/gemm_rows.py [--rows 3072,6144,8192] [--iters 50] [--target Qwen/Qwen3-4B]   (from bench/)

Prints a table (ms per layer, TFLOP/s, the truncated forward's matmul ms per row) and writes
gemm_rows_<target name>.json (gemm_rows_Qwen3-8B.json by default) under $OUT (or bench/results)."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import median, sync, timed, write_json
from dflash_mp.archs import known_target_config
from dflash_mp.target import default_layer_ids

CEILING = 790e12
REPEAT = 10


def layer_gemms(c: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear of one decoder layer."""
    h, i = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


def fused_gemms(c: dict) -> dict[str, tuple[int, int]]:
    """The same layer with q/k/v as one GEMM and gate/up as one: timed beside, not part of the layer."""
    g = layer_gemms(c)
    return {"qkv": (g["q"][0], g["q"][1] + 2 * g["k"][1]), "gate_up": (g["gate"][0], 2 * g["gate"][1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="3072,6144,8192")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--target", default="Qwen/Qwen3-8B", help="a hub id of dflash_mp.archs' table: its layer shapes")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (e.g. --rows 32 --iters 2)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    config = known_target_config(args.target)  # a copy of the table's entry
    if config is None:
        raise SystemExit(f"--target {args.target!r} is not in dflash_mp.archs' table: use one of its hub ids, "
                         f"e.g. Qwen/Qwen3-8B or Qwen/Qwen3-4B")
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    layers = max(default_layer_ids(config["num_hidden_layers"], 5)) + 1  # the forward stops at the last captured
    shapes = layer_gemms(config)
    every = {**shapes, **fused_gemms(config)}
    weights = {n: torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02 for n, (i, o) in every.items()}
    result = {}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(m, i, device=dev, dtype=torch.bfloat16) for i in {i for i, _ in shapes.values()}}

        def layer():
            for n, (i, _) in shapes.items():
                F.linear(xs[i], weights[n])

        timed(layer, 10, dev)
        sync(dev)
        per = {}
        for n, (i, o) in every.items():  # REPEAT back to back a timing: a lone small GEMM's would hold its launch
            ms = median(timed(lambda n=n, i=i: [F.linear(xs[i], weights[n]) for _ in range(REPEAT)], args.iters,
                              dev)) / REPEAT
            per[n] = dict(ms=ms, tflops=2 * m * i * o / ms / 1e9)
        whole = median(timed(lambda: [layer() for _ in range(REPEAT)], args.iters, dev)) / REPEAT
        flop = sum(2 * m * i * o for i, o in shapes.values())
        result[m] = dict(per_gemm=per, layer_ms=whole, tflops=flop / whole / 1e9, mfu=flop / whole / 1e-3 / CEILING,
                         forward_matmul_ms_per_3072=whole * layers * 3072 / m)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    write_json(dict(device=name, torch=torch.__version__, target=args.target, rows=result),
               f"gemm_rows_{args.target.split('/')[-1]}.json")
    print(f"{args.target}: {layers} layers")
    print(f"rows  | layer ms | TFLOP/s | MFU   | {layers}-layer matmul ms per 3072 tokens | per GEMM TFLOP/s")
    for m, r in result.items():
        per = " ".join(f"{n}={v['tflops']:.0f}" for n, v in r["per_gemm"].items())
        print(f"{m:5d} | {r['layer_ms']:8.3f} | {r['tflops']:7.0f} | {r['mfu']:.3f} | "
              f"{r['forward_matmul_ms_per_3072']:34.2f} | {per}")


if __name__ == "__main__":
    main()
