"""Regeneration throughput (`dflash_mp.regenerate`, issue 30 item 2): generated tokens/s of an 8B target
(random weights, bf16) per KV cache and batch size, greedy, 512 new tokens, in one process.

    python bench/regen.py                      # H200: builtin:random-qwen3-8b, 256 prompts, ~300 s in all
    python bench/regen.py --target builtin:random-tiny-qwen3 --device cpu --prompts 8 --new-tokens 16 \\
        --variants static:4,static:8,dynamic:4,dynamic:8 --budget-s 60   # CPU dry run of this script

Prompts: `python -m dflash_mp.builtin make-data` writes `--prompts` conversations; each gives one prompt,
its turns before the first assistant reply (the first turn `regenerate` generates), so N prompts are
N conversations. They are sorted longest first, as `regenerate` sorts a window, and rendered by
`Regenerator.generate` itself: the variants run regenerate's own code on the target that
`dflash_mp.target.load_causal_lm` loads, minus the file I/O.

A variant is `CACHE:ROWS` (`dynamic`: transformers' default cache, eager; `static`: the static cache, whose
decode step transformers compiles on CUDA, batches padded to ROWS rows, prompts to `--prompt-bucket`;
`static-hf:ROWS`: the same with transformers' own sdpa attention instead of regenerate's GQA decode).
Each runs one warm-up batch first (static: the compile and CUDA-graph recordings happen there; dynamic: 4
new tokens), then timed batches over the prompts until they are all done once or its share of what is
left of `--budget-s` is spent (at least one batch; the budget counts from start-up, load and compiles
included, and a variant is skipped once it is gone). Reported per variant: generated tokens/s (real rows
only, each reply up to its stop token), wall time, warm-up time and the compile time it holds (warm-up
minus a timed batch), Dynamo graphs and CUDA graphs recorded (after warm-up both should stay 0; a CUDA
graph recorded again says why, `cudagraph_mismatches`, e.g. a new static cache at a new address), peak
memory, and the memory-bandwidth limit: rows / ((weight bytes + rows x context x KV bytes per token) /
`--bandwidth`), the bytes one decode step must read (the weights once, every row's cache: a static cache
is read whole, filler rows included, a dynamic one as it grows, on average padded prompt + new/2) ->
tokens/s at that batch; `unpadded` is the same limit for the real prompt lengths and rows (what padding
to the bucket and to the rows costs).
The table comes last; JSON goes to `--out` (default $OUT/regen.json, else bench/results/regen.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile
import time

import torch
import torch._dynamo

from common import sync, write_json
from dflash_mp.builtin import resolve_target_path
from dflash_mp.builtin.__main__ import main as builtin_main
from dflash_mp.compile_stats import counts, graph_mismatches
from dflash_mp.data.chat import render_chat
from dflash_mp.regenerate import RegenConfig, Regenerator, bucket_width, resolve_cache
from dflash_mp.target import load_causal_lm, resolve_dtype

DEFAULT_VARIANTS = "static:64,static:128,static:256,dynamic:16,dynamic:64,dynamic:256"
GB = 1e9


def first_turn_prompts(path: str) -> list[list[dict]]:
    """Each conversation's turns before its first assistant reply."""
    prompts = []
    for line in open(path, encoding="utf-8"):
        msgs = json.loads(line)["messages"]
        prompts.append(msgs[: next(i for i, m in enumerate(msgs) if m["role"] == "assistant")])
    return prompts


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """Keys and values of one token over the layers that keep a KV cache (a sliding layer counted whole)."""
    c = model.config.get_text_config(decoder=True)
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    layers = sum(t in ("full_attention", "sliding_attention") for t in types)
    return 2 * layers * c.num_key_value_heads * head_dim * dtype.itemsize


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: all, but the input embedding only where the LM head is it."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if embed is head else total - embed.numel() * embed.element_size()


def bandwidth_limit(rows: float, read_rows: float, context: float, weights: int, kv_per_token: int,
                    bandwidth: float) -> float:
    """Tokens/s of `rows` real rows when a step reads the weights and `read_rows` rows' caches."""
    return rows / ((weights + read_rows * context * kv_per_token) / bandwidth)


def free_bytes(device: torch.device) -> float:
    if device.type != "cuda":
        return float("inf")
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def run_variant(name: str, model, tok, prompts, lengths, a, env, deadline: float, left: int) -> dict:
    kind, rows = name.split(":")
    rows = int(rows)
    device, kv, weights = env["device"], env["kv_bytes_per_token"], env["weight_bytes_per_step"]
    cache = resolve_cache("static" if kind.startswith("static") else kind, model, device)
    r = {"variant": name, "cache": cache, "rows": rows, "gqa_decode": kind == "static"}
    batches = [list(range(i, min(i + rows, len(prompts)))) for i in range(0, len(prompts), rows)]
    width = max(lengths[i] for i in batches[0])  # the longest prompts come first
    cache_len = bucket_width(width, a.prompt_bucket) + a.new_tokens - 1
    need = rows * cache_len * kv + rows * width * env["prefill_bytes_per_token"] + 3 * rows * env["vocab"] * 4
    if need > 0.95 * free_bytes(device):
        return {**r, "skipped": f"needs ~{need / GB:.1f} GB, {free_bytes(device) / GB:.1f} GB free"}
    if time.perf_counter() > deadline:
        return {**r, "skipped": "budget spent"}
    if cache == "static" and a.fresh_compile:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cfg = RegenConfig(max_new_tokens=a.new_tokens, batch_size=rows, prompt_bucket=a.prompt_bucket)
    regen = Regenerator(model, tok, cfg, cache=cache, gqa_decode=kind == "static")
    # Warm-up: the first batch at the timed shape (static: it compiles), or a few tokens (dynamic).
    warm = regen if cache == "static" else Regenerator(model, tok, RegenConfig(max_new_tokens=4, batch_size=rows),
                                                       cache=cache)
    c0, m0, t0 = counts(), graph_mismatches(), time.perf_counter()
    warm.generate([prompts[i] for i in batches[0]])
    sync(device)
    c1 = counts()
    r.update(warmup_s=time.perf_counter() - t0, graphs_warmup=c1["graphs"] - c0["graphs"],
             cudagraph_records_warmup=c1["cudagraph_records"] - c0["cudagraph_records"])
    share = max(0.0, deadline - time.perf_counter()) / left
    tokens0, t0, times, done = regen.new_tokens, time.perf_counter(), [], []
    for b in batches:
        if times and (time.perf_counter() - t0) + times[-1] > share:
            break
        tb = time.perf_counter()
        regen.generate([prompts[i] for i in b])
        sync(device)
        times.append(time.perf_counter() - tb)
        done.append(b)
    wall, c2 = time.perf_counter() - t0, counts()
    new = regen.new_tokens - tokens0
    # Context one decode step reads per row, averaged over the timed batches: a static cache whole (its
    # bucketed prompt + new tokens), a dynamic one as it grows from the batch's padded width.
    pad = (lambda w: bucket_width(w, a.prompt_bucket) + a.new_tokens - 1) if cache == "static" \
        else (lambda w: w + (a.new_tokens - 1) / 2)
    context = sum(pad(max(lengths[i] for i in b)) for b in done) / len(done)
    unpadded = sum(sum(lengths[i] for i in b) / len(b) for b in done) / len(done) + (a.new_tokens - 1) / 2
    real = sum(map(len, done)) / len(done)
    read = rows if cache == "static" else real  # a static batch's filler rows are read too
    limit = bandwidth_limit(real, read, context, weights, kv, a.bandwidth)
    r.update(prompts_timed=sum(map(len, done)), batches_timed=len(done), new_tokens=new, wall_s=wall,
             tokens_per_s=new / wall, batch_s=times, ms_per_step=1000 * wall / (len(done) * a.new_tokens),
             compile_s_est=r["warmup_s"] - min(times) if r["graphs_warmup"] else None,
             graphs_timed=c2["graphs"] - c1["graphs"], cudagraph_records_timed=c2["cudagraph_records"] -
             c1["cudagraph_records"], context_read=context,
             # why recorded CUDA graphs could not be replayed (each miss records anew)
             cudagraph_mismatches={k: v - m0.get(k, 0) for k, v in graph_mismatches().items() if v > m0.get(k, 0)},
             cache_len_max=cache_len if cache == "static" else None,
             bytes_per_step_gb=(weights + read * context * kv) / GB, limit_tokens_per_s=limit,
             fraction_of_limit=new / wall / limit,
             limit_unpadded_tokens_per_s=bandwidth_limit(real, real, unpadded, weights, kv, a.bandwidth))
    if device.type == "cuda":
        r.update(peak_allocated_gb=torch.cuda.max_memory_allocated(device) / GB,
                 peak_reserved_gb=torch.cuda.max_memory_reserved(device) / GB)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="builtin:random-qwen3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="CACHE:ROWS,... (CACHE: dynamic, static, static-hf)")
    ap.add_argument("--prompt-bucket", type=int, default=RegenConfig.prompt_bucket)
    ap.add_argument("--budget-s", type=float, default=300.0, help="the whole run's, from start-up")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s the limit assumes (H200: 4.3e12)")
    ap.add_argument("--fresh-compile", action="store_true", help="reset Dynamo before each static variant, so each "
                    "compiles for its own rows (else a later batch size recompiles with the batch dimension dynamic)")
    ap.add_argument("--cache-dir", default="", help="where builtin targets are built (target.cache_dir)")
    ap.add_argument("--out", default="", help="JSON path (default $OUT/regen.json, else bench/results/regen.json)")
    a = ap.parse_args()
    start = time.perf_counter()
    deadline = start + a.budget_s
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    import transformers

    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    dtype = resolve_dtype(a.dtype, device)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "chats.jsonl")
        builtin_main(["make-data", f"make_data.out={data}", f"make_data.num={a.prompts}"])
        prompts = first_turn_prompts(data)
    path = resolve_target_path(a.target, a.cache_dir)
    t0 = time.perf_counter()
    model = load_causal_lm(path, device, dtype)
    sync(device)
    load_s = time.perf_counter() - t0
    tok = transformers.AutoTokenizer.from_pretrained(path)
    lengths = [len(tok(render_chat(tok, p, {}, True), add_special_tokens=False)["input_ids"]) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: lengths[i], reverse=True)
    prompts, lengths = [prompts[i] for i in order], [lengths[i] for i in order]
    c = model.config.get_text_config(decoder=True)
    default_compile = getattr(model, "_default_compile_config", None)
    env = {"device": device, "kv_bytes_per_token": kv_bytes_per_token(model, dtype),
           "weight_bytes_per_step": weight_bytes_per_step(model), "vocab": c.vocab_size,
           # prefill activations per token, roughly: the residual stream, q/k/v/o and the MLP's three
           "prefill_bytes_per_token": (6 * c.hidden_size + 3 * c.intermediate_size) * dtype.itemsize}
    res = {"target": a.target, "dtype": str(dtype), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "prompts": len(prompts), "new_tokens": a.new_tokens, "prompt_bucket": a.prompt_bucket,
           "prompt_tokens": {"min": min(lengths), "mean": sum(lengths) / len(lengths), "max": max(lengths)},
           "load_s": load_s, "budget_s": a.budget_s, "bandwidth": a.bandwidth,
           "weight_gb_per_step": env["weight_bytes_per_step"] / GB, "kv_bytes_per_token": env["kv_bytes_per_token"],
           "transformers_compile_config": default_compile().to_dict() if default_compile else None,
           "recompile_limit_at_start": torch._dynamo.config.recompile_limit, "variants": []}
    names = [v for v in a.variants.split(",") if v]
    for i, name in enumerate(names):
        try:
            r = run_variant(name, model, tok, prompts, lengths, a, env, deadline, len(names) - i)
        except Exception as e:  # noqa: BLE001 -- an OOM or a compile error ends this variant, not the run
            r = {"variant": name, "error": f"{type(e).__name__}: {e}"[:2000]}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        res["variants"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "batch_s"}), flush=True)
        res["total_s"] = time.perf_counter() - start
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=2)
        else:
            write_json(res, "regen.json")
    print(f"\nregenerate, {res['target']} ({res['dtype']}) on {res['device']}: {len(prompts)} prompts of "
          f"{min(lengths)}-{max(lengths)} tokens (mean {res['prompt_tokens']['mean']:.0f}), {a.new_tokens} new tokens, "
          f"greedy; weights read per step {res['weight_gb_per_step']:.1f} GB, KV {env['kv_bytes_per_token'] / 1e3:.1f} "
          f"KB/token, limit at {a.bandwidth / 1e12:.1f} TB/s; total {res['total_s']:.0f} s (load {load_s:.0f} s)")
    print(f"{'variant':16} {'tok/s':>8} {'wall s':>7} {'prompts':>7} {'warm-up s':>9} {'compile s':>9} {'graphs':>6} "
          f"{'peak GB':>7} {'limit tok/s':>11} {'of limit':>8} {'unpadded':>8}")
    for r in res["variants"]:
        if "tokens_per_s" not in r:
            print(f"{r['variant']:16} {r.get('skipped') or r.get('error', '')[:150]}")
            continue
        graphs = f"{r['graphs_warmup']}+{r['graphs_timed']}"
        compile_s = "-" if r["compile_s_est"] is None else f"{r['compile_s_est']:.1f}"
        print(f"{r['variant']:16} {r['tokens_per_s']:8.0f} {r['wall_s']:7.1f} {r['prompts_timed']:7d} "
              f"{r['warmup_s']:9.1f} {compile_s:>9} {graphs:>6} {r.get('peak_allocated_gb', 0):7.1f} "
              f"{r['limit_tokens_per_s']:11.0f} {r['fraction_of_limit']:8.2f} {r['limit_unpadded_tokens_per_s']:8.0f}")


if __name__ == "__main__":
    sys.exit(main())
