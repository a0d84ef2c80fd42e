"""Shared pieces of the GPU benchmarks: shape presets, realistic synthetic packed batches, timing."""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch

from dflash_mp import blas, process_options, reductions
from dflash_mp.batch import HiddenBatch

# Drafter presets: DFlash drafters at the public configs' shapes.
DRAFTERS = {
    # Qwen3-8B target: 5 drafter layers, hidden 4096, 32/8 heads of 128, K=5 target layers.
    "qwen3_8b": dict(hidden=4096, inter=12288, layers=5, heads=32, kv=8, head_dim=128, vocab=151936,
                     k=5, seq_len=3072, anchors=512, block=16),
    # Qwen3.5-27B target: its 1.7B drafter (conf/drafter/qwen3_5_27b.yaml), four sliding layers and a full one.
    "qwen3_5_27b": dict(hidden=5120, inter=17408, layers=5, heads=32, kv=8, head_dim=128, vocab=248320,
                        k=5, seq_len=3072, anchors=512, block=16, chunk=2048,
                        layer_types=["sliding_attention"] * 4 + ["full_attention"], window=2048),
    # A ~0.6B target (Qwen3-0.6B shapes): launch-bound, where CUDA graphs must pay.
    "qwen3_0p6b": dict(hidden=1024, inter=3072, layers=2, heads=16, kv=8, head_dim=128, vocab=151936,
                       k=5, seq_len=2048, anchors=512, block=16),
    # CPU smoke test of the scripts themselves.
    "tiny": dict(hidden=64, inter=128, layers=1, heads=4, kv=2, head_dim=16, vocab=512,
                 k=3, seq_len=256, anchors=32, block=8),
}

QWEN3_8B_TARGET = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False)


def doc_lengths(seq_len: int, gen: torch.Generator, lo: int = 256, hi: int = 2048) -> list[int]:
    """Conversation lengths drawn uniformly in [lo, hi] until the row is full (last one trimmed)."""
    out, used = [], 0
    while used < seq_len:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        n = min(n, seq_len - used)
        out.append(n)
        used += n
    return out


def synthetic_batch(seq_len: int, hidden_dim: int, vocab: int, device, dtype, seed: int = 0,
                    lo: int = 256, hi: int = 2048) -> HiddenBatch:
    """A full packed row: documents of 256-2048 tokens, the first 30% of each a user turn
    (loss 0), the rest the assistant's (loss 1); random token ids and hidden states."""
    g = torch.Generator().manual_seed(seed)
    lens = doc_lengths(seq_len, g, min(lo, seq_len), min(hi, seq_len))
    ids = torch.randint(0, vocab - 16, (seq_len,), generator=g)
    pos, docs, mask = [], [], []
    for i, n in enumerate(lens):
        pos.append(torch.arange(n))
        docs.append(torch.full((n,), i))
        m = torch.zeros(n, dtype=torch.long)
        m[int(0.3 * n):] = 1
        mask.append(m)
    hidden = (torch.randn(seq_len, hidden_dim, generator=g) * 0.5).to(dtype)
    return HiddenBatch(hidden=hidden, input_ids=ids, position_ids=torch.cat(pos), doc_ids=torch.cat(docs),
                       loss_mask=torch.cat(mask), num_valid_tokens=seq_len).to(device)


@contextlib.contextmanager
def blas_library(name: str | None, device):
    """The block's matmuls through torch's BLAS library `name` ("cublaslt"), PyTorch's choice restored
    after it; None or a device other than CUDA changes nothing (the benches' `lt` variants)."""
    if name is None or torch.device(device).type != "cuda":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


@contextlib.contextmanager
def block_kernel_settings(tiles: dict | None = None, use_tma: bool | None = None,
                          heads_first: frozenset | None = None, whole_tiles: bool | None = None):
    """The Triton block kernels' module settings (dflash_mp/model/block_attn.py, read at each launch) as
    given for the body and restored after it, whatever it raises: `tiles` updates TILES; None leaves a
    setting as it is (the benches' `btiles`, `bptr`, `heads*` and `masked` variants)."""
    from dflash_mp.model import block_attn

    saved = dict(block_attn.TILES), block_attn.USE_TMA, block_attn.HEADS_FIRST, block_attn.WHOLE_TILES
    try:
        if tiles is not None:
            block_attn.TILES.update(tiles)
        if use_tma is not None:
            block_attn.USE_TMA = use_tma
        if heads_first is not None:
            block_attn.HEADS_FIRST = heads_first
        if whole_tiles is not None:
            block_attn.WHOLE_TILES = whole_tiles
        yield
    finally:
        block_attn.TILES.clear()
        block_attn.TILES.update(saved[0])
        block_attn.USE_TMA, block_attn.HEADS_FIRST, block_attn.WHOLE_TILES = saved[1:]


# The calls from which a job's process has run with each option's default (BENCHMARKS.md).
DEFAULT_SINCE = {"target": {"cublas_workspace": "G4", "reduction_configs": "I2"},
                 "train": {"cublas_workspace": "H2", "reduction_configs": "I2"}}


def add_process_options(ap, section: str) -> None:
    """--cublas-workspace and --reduction-configs: the bench process's `section` options (dflash_mp/
    process_options.py), the job's defaults unless told otherwise."""
    since = DEFAULT_SINCE[section]
    ap.add_argument("--cublas-workspace", default="none", choices=blas.CHOICES,
                    help=f"{section}.cublas_workspace (dflash_mp/blas.py): none (the default, as a job's since call "
                         f"{since['cublas_workspace']}) or torch (PyTorch's sizes, as every figure before it)")
    ap.add_argument("--reduction-configs", default="heuristic", choices=reductions.CHOICES,
                    help=f"{section}.reduction_configs (dflash_mp/reductions.py): heuristic (the default, as a job's "
                         f"since call {since['reduction_configs']}) or timed (as every figure before it)")


def apply_process_options(a, device, section: str) -> dict:
    """Apply add_process_options' arguments before the bench's first GEMM and compile, as a job does; what
    applies, for the results' JSON."""
    process_options.apply(a, device, section)
    return {"cublas_workspace": blas.describe(device), "reduction_configs": reductions.describe(device)}


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, n: int, device) -> list[float]:
    """Per-iteration milliseconds (CUDA events on GPU, wall clock on CPU)."""
    out = []
    for _ in range(n):
        if torch.device(device).type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - t))
    return out


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def write_json(obj, name: str) -> None:
    """To $OUT when set (the GPU machine), else to bench/results/."""
    out = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=2)


KERNEL_CLASSES = (  # first match wins (a class may have several rows); lowercased substrings of kernel names
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("flex_attention", ("flex",)),
    # Inductor's other templates are its GEMMs (max-autotune): "triton_tem_fused_mm_t_view_2", or with the ops
    # fused around one, "..._mean_mm_mul_pow_rsqrt_silu_...". flex_attention's hold "flex_attention" (above),
    # also where a prologue brings a bmm ("..._add_bmm_cat_cos_flex_attention_...").
    ("matmul", ("triton_tem",)),
    ("block_attention", ("block_attn",)),  # the Triton block kernels (drafter.attention=triton)
    ("doc_attention", ("doc_attn_fwd",)),  # the target's Triton kernel (target.attn_implementation=triton)
    ("loss", ("stats_tiles_kernel", "stats_lanes_kernel", "grad_kernel")),  # model/ce_kernels_triton.py
    # Inductor names a fused kernel after the ops in it: AdamW's update (optim.adamw_update) is the step's
    # only torch.lerp. Its names also hold "_to_copy" and "copy_", which made it a "copy" before.
    ("optimizer", ("multi_tensor", "adam", "foreach", "lerp")),
    # Data movement only: not "copy_", which Inductor writes for dtype casts (`_to_copy`) and in-place copies.
    ("copy", ("memcpy", "memset", "catarraybatched", "direct_copy")),
    # Before "attention": Inductor names its fused kernels after the ops around them ("..._doc_attention_...").
    ("fused_triton", ("triton_",)),
    ("attention", ("fmha", "flash", "attention")),
    ("linear_attention", ("chunk", "delta", "conv1d", "solve_tril", "l2norm", "recompute_w_u", "kkt", "cumsum")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
    ("reduce", ("reduce", "norm")),
)


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel, by its name (KERNEL_CLASSES; `other` where nothing matches)."""
    name = name.lower()
    return next((c for c, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")


def kernel_profile(step, device, n: int = 3, top: int = 30) -> dict:
    """GPU time per kernel class over `n` calls of `step` (ms per call), and the `top` costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize(device)
    per: dict[str, float] = {}
    kernels = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if not us or ev.key.startswith("ProfilerStep"):
            continue
        cls = kernel_class(ev.key)
        per[cls] = per.get(cls, 0.0) + us / 1000 / n
        kernels.append((us / 1000 / n, ev.count // n, ev.key[:120]))
    kernels.sort(reverse=True)
    return {"ms_per_step_by_class": dict(sorted(per.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"ms": round(ms, 3), "calls": c, "name": k} for ms, c, k in kernels[:top]],
            "idle": idle_profile(prof, n)}


def idle_profile(prof, n: int, top: int = 15) -> dict:
    """Where the GPU does nothing: the union of all streams' kernel and copy intervals over the
    profiled calls, and the idle gaps before each kernel name (ms per call), the largest first."""
    try:
        spans = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                       if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start)
    except (AttributeError, TypeError) as e:  # the profiler's event API moved
        return {"error": repr(e)}
    if not spans:
        return {}
    busy = idle = 0.0
    gaps: dict[str, list] = {}
    cur_s, cur_e = spans[0][:2]
    for s, e, name in spans[1:]:
        if s > cur_e:
            gap = gaps.setdefault(name[:90], [0.0, 0])
            gap[0] += s - cur_e
            gap[1] += 1
            idle += s - cur_e
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    worst = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
    return {"span_ms": (spans[-1][1] - spans[0][0]) / 1000 / n, "busy_ms": busy / 1000 / n,
            "idle_ms": idle / 1000 / n, "gaps": sum(g[1] for g in gaps.values()) / n,
            "idle_before": [{"ms": round(g[0] / 1000 / n, 3), "gaps": g[1] / n, "name": k} for k, g in worst]}


def kernel_sources(step, device, top: int = 20) -> list[dict]:
    """Which ops launch the GPU's kernels in one call of `step`: per launching op (an aten op, or an
    Inductor kernel launched as itself), the number of kernels, their GPU time and some of their
    names, the most kernels first. Small kernels cost launch gaps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    out: dict[str, list] = {}
    try:
        for ev in prof.events():
            kernels = getattr(ev, "kernels", None) or []
            if ev.device_type != torch.autograd.DeviceType.CPU or not kernels:
                continue
            row = out.setdefault(ev.name[:110], [0, 0.0, set()])
            row[0] += len(kernels)
            row[1] += sum(k.duration for k in kernels) / 1000
            row[2].update(k.name[:40] for k in kernels)
    except (AttributeError, TypeError) as e:
        return [{"error": repr(e)}]
    rows = sorted(out.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"op": k, "kernels": v[0], "ms": round(v[1], 3), "names": sorted(v[2])[:4]} for k, v in rows]
