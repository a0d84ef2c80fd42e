"""Drafter training step at DFlash shapes: eager vs torch.compile default vs reduce-overhead
(CUDA Graph Trees), in one run, with every real feature on (RoPE, document masks, on-device anchor
sampling, chunked fused CE, loss masks, AdamW, grad clipping).

    python bench/drafter_step.py --preset qwen3_8b --modes eager,default,reduce-overhead
    # the update reading `.grad` (one GPU's default) against the copy into the flat buffer:
    python bench/drafter_step.py --preset qwen3_8b --scope layers --modes default+ce=triton,default+ce=triton+flatgrads

MFU = counted model FLOPs (dflash_mp.flops; the frozen LM head counts forward + input gradient)
/ step time / 790 TFLOP/s (measured bf16 matmul ceiling of one H200). The step time is that of
steps run back to back with one sync at the end, as training runs them; `ms_per_step_synced` is
the median of steps each waited for by the host.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from common import DRAFTERS, add_process_options, apply_process_options, blas_library, block_kernel_settings, kernel_profile, kernel_sources, median, synthetic_batch, timed, write_json
from dflash_mp.compile_stats import counts, graph_mismatches
from flex_tiles import DEFAULT_TILES, TRITON_VARIANTS, VARIANTS as TILES
from dflash_mp import trainer as trainer_module
from dflash_mp.gpu_memory import give_back_cached, memory_scalars
from dflash_mp.flops import DrafterShape, drafter_attention_flops, drafter_matmul_flops
from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.optim import adamw_update_each, global_norm
from dflash_mp.reductions import UNTIMED_POINTWISE
from dflash_mp.target.weights import random_target_head
from dflash_mp.trainer import (DFlashObjective, DrafterConfig, DrafterTrainer, TrainConfig,
                               layer_scope_modules)

PEAK = 790e12


def opt(x, width: int, digits: int) -> str:
    """A table cell of a figure a mode may not have (None: not measured in that mode, e.g. the split of
    a step replayed as one CUDA graph into forward/backward and update)."""
    return f"{x:{width}.{digits}f}" if x is not None else f"{'-':>{width}}"


def parse_mode(mode: str) -> tuple[str, dict]:
    """`default+ce=triton+amp+tiles=bwd64` -> ("default", {"ce": "triton", "amp": True, "tiles": "bwd64"}).

    Suffixes: `+ce=KERNEL` train.loss_kernel=KERNEL (eager, inductor or triton; without it the CE
    runs eager); `+loss` is `+ce=inductor` (the name of earlier runs);
    `+amp` train.precision=amp (fp32 weights under autocast; the default is bf16 working weights);
    `+tiles=NAME` the flex BlockMask size and kernel options of bench/flex_tiles.py's variant NAME;
    `+addgrads` backward adds into `.grad` views of the flat buffer, zeroed after each step;
    `+flatgrads` each step's gradients are copied from `.grad` into the flat buffer
    (FlatAdamW.collect), as with CUDA graphs or data parallelism (the default, one GPU without CUDA
    graphs: the update reads `.grad` itself, no copy, no buffer); `+serial` train.optimizer_overlap
    =false (the update runs after backward on the compute stream, not per layer on a side stream);
    `+attn=BACKEND` drafter.attention=BACKEND (triton, flex, dense; without it: auto);
    `+btiles=NAME` the Triton block kernels' tiles of bench/flex_tiles.py's TRITON_VARIANTS[NAME];
    `+bptr` the Triton block kernels load their context key/value tiles through pointers
    (block_attn.USE_TMA=False; without it, through tensor descriptors on sm_90+);
    `+nograph` train.cuda_graph=false (every step launched from Python; the default captures the
    step as one CUDA graph at step 3 where it can, step_graph.py);
    `+fullrows` every block row through every drafter layer (DFlashObjective.shared_mask_rows=False;
    the default projects a block's mask slots once in the first layer and computes slots 1..B-1 only
    in the last); `+foreachnorm` the clip norm through `_foreach_norm` (optim.global_norm; the
    default, compiled, reduces each gradient in Inductor's kernels); `+headslast` every block kernel's
    programs start head by head (block_attn.HEADS_FIRST empty); `+headsall` every kernel's start every
    KV head's program of a place in the order before the next place, longest first over all heads (the
    default: the dK/dV kernel's only); `+fullmaster` a separate fp32 master beside the bf16 working
    weights (the default keeps the master as the working weights and their int16 lower halves:
    optim.py's split master); `+masked` every key tile of the block kernels masked
    (block_attn.WHOLE_TILES=False; the default skips the mask on the tiles every row sees whole); `+lt`
    the matmuls through cuBLASLt
    (torch.backends.cuda.preferred_blas_library("cublaslt") for this mode's run; the default: cuBLAS);
    `+swiglu` the MLPs' gate/up GEMM with the SwiGLU as its epilogue and the SwiGLU's gradient in the
    down projection's backward GEMM (swiglu.swiglu_mlp; the default: cuBLAS GEMMs and Inductor's
    pointwise kernels); `+keepcache` the trainer keeps what its build left in the allocator's cache
    (the default gives it back, gpu_memory.give_back_cached); `+opttimed` the optimizer's update
    compiled with its pointwise configs timed at the first step, on clones of the buffers it updates
    (the default since call Q14 takes them untimed: reductions.UNTIMED_POINTWISE); `+pwuntimed` the
    drafter's compiled layers and norms with their pointwise configs untimed too, as the target's layers
    (the default times two configs of each at the first step)."""
    base, *flags = mode.split("+")
    out: dict = {}
    for f in flags:
        key, _, val = f.partition("=")
        if key not in ("loss", "ce", "amp", "tiles", "btiles", "addgrads", "flatgrads", "serial", "attn",
                       "nograph", "bptr", "fullrows", "foreachnorm", "headslast", "headsall", "fullmaster", "masked",
                       "lt", "swiglu", "keepcache", "opttimed", "pwuntimed") or (
                key in ("tiles", "btiles", "ce", "attn")) != bool(val) or (key == "btiles" and val not in TRITON_VARIANTS):
            raise ValueError(f"mode suffix {f!r}: use +ce=KERNEL, +attn=BACKEND, +loss, +amp, +addgrads, +flatgrads, "
                             f"+serial, +nograph, +bptr, +fullrows, +foreachnorm, +headslast, +headsall, +fullmaster, "
                             f"+masked, +lt, +swiglu, +keepcache, +opttimed, +pwuntimed, "
                             f"+tiles=NAME or +btiles=NAME (NAME in {sorted(TRITON_VARIANTS)})")
        out[key] = val or True
    if out.pop("loss", False):
        out["ce"] = "inductor"
    return base, out


def build(p: dict, mode: str, device, chunk: int, scope: str = "step", attention: str = "auto") -> DrafterTrainer:
    """`mode`: a train.compile value with parse_mode's suffixes."""
    mode, flags = parse_mode(mode)
    attention = flags.get("attn", attention)
    tiles = {}
    if "tiles" in flags:
        size, opts = TILES[flags["tiles"]]
        tiles = dict(flex_block_size=size, flex_kernel_options=dict(opts or {}))
    torch.manual_seed(0)
    args = DrafterArgs(hidden_size=p["hidden"], intermediate_size=p["inter"], num_layers=p["layers"],
                       num_heads=p["heads"], num_kv_heads=p["kv"], head_dim=p["head_dim"], vocab_size=p["vocab"],
                       target_layer_ids=list(range(1, 1 + p["k"])), block_size=p["block"],
                       mask_token_id=p["vocab"] - 1, layer_types=p.get("layer_types"),
                       sliding_window=p.get("window"))
    with torch.device(device):
        drafter = DFlashDrafter(args)
    if "swiglu" in flags:
        from dflash_mp.swiglu import swiglu_mlp

        for layer in drafter.layers:
            layer.mlp.fused = swiglu_mlp
    wdt = torch.bfloat16 if device.type == "cuda" else torch.float32
    # As a job's drafter rank draws a random target's (so the build leaves the allocator what a job's does)
    embed, head = random_target_head({"vocab_size": p["vocab"], "hidden_size": p["hidden"]}, 1, device, wdt)
    cfg = DrafterConfig(num_layers=p["layers"], block_size=p["block"], num_anchors=p["anchors"],
                        max_anchors_per_doc=p["anchors"], loss_chunk_size=chunk, attention=attention,
                        layer_types=p.get("layer_types"), sliding_window=p.get("window"), **tiles)
    obj = DFlashObjective(drafter, args, embed, head, cfg)
    obj.shared_mask_rows = "fullrows" not in flags
    cfg = TrainConfig(compile=mode, compile_scope=scope, loss_kernel=flags.get("ce", "eager"), max_steps=10_000,
                      warmup_ratio=0.0, precision="amp" if "amp" in flags else "auto",
                      optimizer_overlap="serial" not in flags, cuda_graph="nograph" not in flags)
    if "keepcache" in flags:  # the trainer module's name for it, for this build only
        trainer_module.give_back_cached = lambda device, what: 0
    try:
        tr = DrafterTrainer(obj, cfg, 10_000, None, device, write_grads="addgrads" not in flags,
                            direct_grads="flatgrads" not in flags, split_master="fullmaster" not in flags)
    finally:
        trainer_module.give_back_cached = give_back_cached
    if "foreachnorm" in flags:
        tr.opt.grad_norm = global_norm
    if "opttimed" in flags and device.type == "cuda":  # the trainer compiles it on CUDA, in every mode
        tr.opt._update = torch.compile(adamw_update_each, dynamic=False, fullgraph=True)
    if "pwuntimed" in flags and mode != "eager" and scope == "layers":  # compiled anew, with the options
        for module in layer_scope_modules(drafter):
            module.compile(dynamic=False, options=UNTIMED_POINTWISE)
    return tr


def flops_per_step(p: dict, stats: dict, steps: int) -> float:
    s = DrafterShape(p["hidden"], p["inter"], p["layers"], p["heads"], p["kv"], p["head_dim"], p["vocab"], p["k"])
    b = p["block"]
    pairs = p["layers"] * (float(stats["ctx_keys"]) * b + float(stats["blocks"]) * b * b)
    return drafter_matmul_flops(s, p["seq_len"], p["anchors"], b) + drafter_attention_flops(s, pairs) / steps


def segments(device) -> dict:
    """Where the allocator's cache lies: segments wholly free (what empty_cache returns) and the free
    bytes inside segments that still hold live tensors (what it cannot), with the segments holding most
    of it (size, allocated, their largest live blocks). MiB."""
    mib = 2**20
    segs = [g for g in torch.cuda.memory_snapshot() if g["device"] == (device.index or 0)]
    used = [g for g in segs if g["allocated_size"] > 0]
    worst = sorted(used, key=lambda g: g["total_size"] - g["allocated_size"], reverse=True)[:6]
    free = sum(g["total_size"] for g in segs if g["allocated_size"] == 0)
    return {"segments": len(segs), "free_segments_mib": round(free / mib),
            "free_in_used_mib": round(sum(g["total_size"] - g["allocated_size"] for g in used) / mib),
            "most_free": [{"size": round(g["total_size"] / mib),
                           "allocated": round(g["allocated_size"] / mib),
                           "live_blocks": sorted((round(b["size"] / mib, 1) for b in g["blocks"]
                                                  if b["state"] == "active_allocated"), reverse=True)[:4]}
                          for g in worst]}


def run_mode(p, mode, device, batches, warmup, steps, chunk, scope, sources=False) -> dict:
    cuda = device.type == "cuda"
    if cuda:  # this mode's peaks: its build, its warm-up (compile, launched steps, the capture), its steps
        torch.cuda.reset_peak_memory_stats(device)
    tr = build(p, mode, device, chunk, scope)
    built = {"reserved": torch.cuda.memory_reserved(device) / 2**30,
             "allocated": torch.cuda.memory_allocated(device) / 2**30,
             "segments": segments(device)} if cuda else {}
    i = [0]

    def step(tr=tr, wait=True):
        tr.train_step(batches[i[0] % len(batches)])
        i[0] += 1
        if wait:  # the timing event comes after this step's update, wherever it ran
            tr.opt.wait_all()

    warm, by_step = [], []  # by_step: after each warm-up step, what is reserved and the peaks so far
    for _ in range(warmup):  # (the first compiles; the last launched one precedes the capture)
        warm += timed(step, 1, device)
        if cuda:
            got = {k.removeprefix("memory/"): round(v, 3) for k, v in memory_scalars(device).items()}
            by_step.append(dict(got, allocated_gib=round(torch.cuda.memory_allocated(device) / 2**30, 3),
                                segments=segments(device)))
    warmed = memory_scalars(device)
    tr.stats.pop()
    c0, m0 = counts(), graph_mismatches()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    synced = timed(step, steps, device)  # one step at a time, the host waiting for each
    # As training runs: steps back to back, the host queueing ahead, one sync at the end.

    def back_to_back(step=step):
        for k in range(steps):
            step(wait=k == steps - 1)

    ms = timed(back_to_back, 1, device)[0] / steps
    c1, m1 = counts(), graph_mismatches()
    st = tr.stats.pop()
    # Where a step's time goes: forward+backward vs optimizer (norm + clip/AdamW + zeroing), as the
    # trainer times the step before each log (CUDA events; wall clock on CPU).
    phases, losses = [], []
    for _ in range(5):
        tr.train_step(batches[i[0] % len(batches)], timed=True)
        i[0] += 1
        phases.append(tr.phase_ms())
        # Steps 24-28 of a seeded sequence, as the job runs them (replayed where the step is a CUDA
        # graph): the loss and the gradient norm, comparable with another process's.
        st_k = tr.stats.pop()
        losses.append([float(st_k["loss_sum"]), float(st_k["gnorm_sum"])])
    # A replayed step is one phase ("step"): forward, backward and update inside one graph.
    fb, op = [ph.get("fwd_bwd") for ph in phases], [ph.get("optimizer") for ph in phases]
    whole = [ph["step"] for ph in phases if "step" in ph]
    serial = not tr.opt.on_side_stream and not whole  # else the update is not in the optimizer phase
    prof = kernel_profile(step, device, top=60) if device.type == "cuda" else None
    if prof is not None and sources:
        try:
            prof["sources"] = kernel_sources(step, device)
        except Exception as e:  # a diagnostic: it must not lose the mode's figures
            prof["sources"] = [{"error": f"{type(e).__name__}: {e}"[:300]}]
    flops = flops_per_step(p, st, 2 * steps)
    out = {
        "mode": mode, "ms_per_step": ms, "ms_per_step_synced": median(synced), "ms_min_synced": min(synced),
        "samples_per_s": 1000 / ms,
        "ctx_tokens_per_s": p["seq_len"] * 1000 / ms, "tflop_per_step": flops / 1e12,
        "mfu": flops / (ms / 1000) / PEAK, "warmup_ms": warm,
        "recompiles_after_warmup": c1["graphs"] - c0["graphs"],
        "cudagraph_records_after_warmup": c1["cudagraph_records"] - c0["cudagraph_records"],
        "cudagraph_replay_misses_after_warmup": {k: v - m0.get(k, 0) for k, v in m1.items() if v > m0.get(k, 0)},
        "graphs_total": c1["graphs"],
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0,
        # Reserved too: a captured step's activations and gradients live in its graph's pool, whose blocks
        # the allocator counts as allocated only while the capture holds them (not during replays).
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else 0.0,
        # Before the timed steps (whose peaks are the two above): once built, and the build's and
        # warm-up's peaks, the whole process's as a job's `memory/max_reserved_gib` counts it.
        "built_reserved_gib": built.get("reserved"), "built_allocated_gib": built.get("allocated"),
        "warmup_peak_reserved_gib": warmed.get("memory/max_reserved_gib"),
        "warmup_peak_allocated_gib": warmed.get("memory/max_allocated_gib"),
        "built_segments": built.get("segments"), "warmup_memory_by_step": by_step or None,
        "fwd_bwd_ms": None if whole else median(fb), "optimizer_ms": None if whole else median(op),
        "graph_step_ms": median(whole) if whole else None,
        "cuda_graph": tr.describe_graph(), "graph_replays": tr.graph.replays if tr.graph else 0,
        "optimizer_tb_per_s": tr.opt.num_bytes_per_step / median(op) / 1e9 if serial else None,
        "optimizer_overlap": not serial,
        "direct_grads": tr.opt.direct,  # the update read `.grad` (no flat gradient buffer)
        "losses_and_grad_norms": losses,
        "profile": prof,
    }
    del step, back_to_back, tr
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def compile_seconds() -> dict[str, float]:
    """Cumulative seconds per compile phase so far (Dynamo's own counters), the largest first."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    tot = {k: round(sum(v), 1) for k, v in compilation_time_metrics.items() if v}
    return dict(sorted(tot.items(), key=lambda kv: -kv[1])[:12])


def loss_curve(p, mode, device, batches, n, chunk, scope, attention="auto") -> list[float]:
    tr = build(p, mode, device, chunk, scope, attention)
    torch.manual_seed(123)
    out = [_one(tr, batches[k % len(batches)]) for k in range(n)]
    del tr
    gc.collect()
    return out


def _one(tr, hb) -> float:
    tr.set_lr()
    loss = tr.forward_backward(hb).item()
    tr.optimizer_step()
    return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3_8b", choices=sorted(DRAFTERS))
    ap.add_argument("--modes", default="eager,default,reduce-overhead",
                    help="train.compile values with parse_mode's suffixes: +ce=KERNEL, +attn=BACKEND, +loss, +amp, "
                         "+addgrads, +flatgrads (gradients copied into the flat buffer: FlatAdamW.collect), "
                         "+serial, +tiles=NAME")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--loss-steps", type=int, default=0, help="compare eager's losses with --loss-mode's")
    ap.add_argument("--loss-mode", default=None, help="default: the last compiled mode in --modes")
    ap.add_argument("--chunk", type=int, default=None, help="CE rows per chunk (default: the preset's, else 4096)")
    ap.add_argument("--scope", default="step", choices=["step", "layers"], help="train.compile_scope")
    ap.add_argument("--sources", action="store_true", help="also count the first mode's kernels by the op that launches them")
    add_process_options(ap, "train")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = apply_process_options(a, device, "train")
    p = DRAFTERS[a.preset]
    a.chunk = a.chunk or p.get("chunk", 4096)
    wdt = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [synthetic_batch(p["seq_len"], p["k"] * p["hidden"], p["vocab"], device, wdt, seed=s) for s in range(4)]
    results = {"preset": a.preset, "scope": a.scope, "shape": p, "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               **options, "modes": []}
    from dflash_mp.model import block_attn

    for mode in a.modes.split(","):
        try:
            flags = parse_mode(mode)[1]
            # The block kernels read their settings at each launch: set for this mode's run only.
            heads = {"headslast": frozenset(), "headsall": frozenset(block_attn.KERNELS)}
            settings = block_kernel_settings(
                tiles=dict(DEFAULT_TILES, **TRITON_VARIANTS[flags["btiles"]]) if flags.get("btiles") else None,
                use_tma=False if flags.get("bptr") else None,
                heads_first=next((heads[k] for k in heads if flags.get(k)), None),
                whole_tiles=False if flags.get("masked") else None)
            with settings, blas_library("cublaslt" if flags.get("lt") else None, device):
                r = run_mode(p, mode, device, batches, a.warmup, a.steps, a.chunk, a.scope,
                             a.sources and not results["modes"])
        except Exception as e:  # one mode failing must not lose the others' figures
            r = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:2000]}
        r["compile_s"] = compile_seconds()  # cumulative over the process: where warm-up time went
        results["modes"].append(r)
        print(r, flush=True)
        write_json(results, f"drafter_{a.preset}_{a.scope}.json")
    if a.loss_steps:
        other = a.loss_mode or [m for m in a.modes.split(",") if m != "eager"][-1]
        curves = {m: loss_curve(p, m, device, batches, a.loss_steps, a.chunk, a.scope) for m in ("eager", other)}
        e, c = curves["eager"], curves[other]
        # bf16 noise floor: eager against eager with another attention kernel (sdpa on the dense mask
        # instead of flex_attention on the BlockMask): the same math, other rounding, as compiling is.
        try:
            base = loss_curve(p, "eager", device, batches, a.loss_steps, a.chunk, a.scope, attention="dense")
        except Exception as err:  # the dense mask path must not lose the comparison above
            base = None
            print(f"dense baseline failed: {type(err).__name__}: {err}"[:500], flush=True)

        def rel(xs, ys):
            r = [abs(x - y) / abs(x) for x, y in zip(xs, ys)]
            return max(r), sum(r) / len(r)

        mx, mean = rel(e, c)
        results["loss_match"] = {"mode": other, "steps": a.loss_steps, "max_rel_diff": mx, "mean_rel_diff": mean,
                                 "eager_first_last": [e[0], e[-1]], "compiled_first_last": [c[0], c[-1]],
                                 "curves": curves}  # seeded: comparable with another process's
        if base is not None:
            bmx, bmean = rel(e, base)
            results["loss_match"]["eager_vs_eager_dense_attention"] = {
                "max_rel_diff": bmx, "mean_rel_diff": bmean, "dense_first_last": [base[0], base[-1]]}
        write_json(results, f"drafter_{a.preset}_{a.scope}.json")
    print(f"\n{a.preset} on {results['device']} (torch {torch.__version__})")
    print(f"{'mode':26} {'ms/step':>9} {'sync ms':>8} {'samples/s':>10} {'MFU':>6} {'recomp':>7} {'cg-rec':>7} "
          f"{'peakGiB':>8} {'fb ms':>7} {'opt ms':>7} {'opt TB/s':>8} {'graph':>6}")
    for r in results["modes"]:
        if "error" in r:
            print(f"{r['mode']:26} ERROR {r['error'][:100]}")
            continue
        print(f"{r['mode']:26} {r['ms_per_step']:9.2f} {r['ms_per_step_synced']:8.2f} {r['samples_per_s']:10.2f} "
              f"{r['mfu']:6.3f} {r['recompiles_after_warmup']:7d} {r['cudagraph_records_after_warmup']:7d} "
              f"{r['peak_mem_gib']:8.1f} {opt(r['fwd_bwd_ms'], 7, 1)} {opt(r['optimizer_ms'], 7, 1)} "
              f"{opt(r['optimizer_tb_per_s'], 8, 2)} {r['graph_replays']:6d}")
    if "loss_match" in results:
        print("loss match:", results["loss_match"])
    for r in results["modes"]:
        if r.get("profile"):
            cls = ", ".join(f"{k} {v:.1f}" for k, v in r["profile"]["ms_per_step_by_class"].items())
            print(f"{r['mode']} GPU ms/step by kernel class: {cls}")
            if r.get("cudagraph_replay_misses_after_warmup"):
                print(f"{r['mode']} CUDA graph replay misses after warm-up: {r['cudagraph_replay_misses_after_warmup']}")
            for src in r["profile"].get("sources", [])[:12]:
                print(f"  {src.get('kernels', 0):4d} kernels {src.get('ms', 0):7.3f} ms  {src.get('op', src)}")
            idle = r["profile"].get("idle") or {}
            if "idle_ms" in idle:
                print(f"{r['mode']} GPU idle {idle['idle_ms']:.2f} ms/step in {idle['gaps']:.0f} gaps "
                      f"(busy {idle['busy_ms']:.1f}); before: "
                      + "; ".join(f"{g['name'][:40]} {g['ms']:.2f}" for g in idle["idle_before"][:6]))


if __name__ == "__main__":
    sys.exit(main())
