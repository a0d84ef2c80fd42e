"""Where a compiled Qwen3.5-MoE layer parts from the eager one (issue 28: the compiled 35B-A3B's
features were 64-68% off the eager ones on an H200). Builds the 35B-A3B's architecture with 4 layers
(random weights, bf16, on the GPU) and compares, on one hidden-state row of T tokens, the eager and
the compiled form of: the sparse MoE block, its router, its experts (the default experts
implementation and each other one), its shared expert, and whole decoder layers (linear and full
attention). Prints relative differences per token (mean / max); rounding is ~1e-2.

    python bench/moe_compile_probe.py [--arch Qwen/Qwen3.5-35B-A3B] [--seq-len 3072]
Writes $OUT/moe_compile_probe.json (or bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from dflash_mp.archs import HF_ARCHS, TINY_ARCHS, hf_config, hybrid_layer_types  # noqa: E402


def rel(a, b) -> tuple[float, float]:
    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    r = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
    return float(r.mean()), float(r.max())


def main() -> None:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="Qwen/Qwen3.5-35B-A3B")
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--device", default="cuda")  # cpu with --arch tiny-qwen3.5-moe: a dry run
    a = ap.parse_args()
    dev = torch.device(a.device)
    arch = HF_ARCHS[a.arch] if a.arch in HF_ARCHS else TINY_ARCHS[a.arch]
    cfg = hf_config(arch, num_hidden_layers=4, layer_types=hybrid_layer_types(4))
    torch.manual_seed(0)
    with dev:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    dec = model.get_decoder()
    h = torch.randn(1, a.seq_len, cfg.hidden_size, device=dev, dtype=next(model.parameters()).dtype)
    x = h.view(-1, cfg.hidden_size)
    block = dec.layers[0].mlp
    print("experts implementation:", getattr(block.experts.config, "_experts_implementation", None))
    rows = {}

    def probe(name, fn, *args):
        torch._dynamo.reset()
        with torch.inference_mode():
            want = fn(*args)
            try:
                got = torch.compile(fn, dynamic=False)(*args)
            except Exception as e:  # noqa: BLE001 - a probe reports, it does not stop
                rows[name] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"{name:<40} {rows[name]}")
                return
        want = want[0] if isinstance(want, tuple) else want
        got = got[0] if isinstance(got, tuple) else got
        rows[name] = rel(got, want)
        print(f"{name:<40} mean {rows[name][0]:.2e}  max {rows[name][1]:.2e}")

    probe("moe block", block, h)
    with torch.inference_mode():
        _, weights, experts = block.gate(x)
    probe("router (weights)", lambda x: block.gate(x)[1], x)
    probe("router (indices, as float)", lambda x: block.gate(x)[2].float(), x)
    probe("shared expert", block.shared_expert, x)
    impl = block.experts.config._experts_implementation
    for other in (impl, "batched_mm", "eager"):
        block.experts.config._experts_implementation = other
        probe(f"experts ({other})", lambda x: block.experts(x, experts, weights), x)
    block.experts.config._experts_implementation = impl
    pos = torch.arange(a.seq_len, device=dev)[None]
    rope = dec.rotary_emb(h, pos[None].expand(3, 1, -1))
    for i in (0, 3):
        probe(f"decoder layer {i} ({cfg.layer_types[i]})",
              lambda h: dec.layers[i](h, attention_mask=None, position_ids=pos, position_embeddings=rope), h)
    out_dir = os.environ.get("OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "moe_compile_probe.json"), "w") as f:
        json.dump({"arch": a.arch, "experts_implementation": impl, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
