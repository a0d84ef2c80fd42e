"""Packed-document causal attention in Triton for the frozen target (`target.attn_implementation=triton`,
the CUDA default where the shapes allow it): a forward-only kernel that knows the mask's shape.

In a packed row, token i sees the keys [low_i, i]: low_i is its document's first token (or, on a
sliding-window layer, i - W + 1 when that is later). Both bounds ascend with i, so a tile of query
rows sees one contiguous key range, and inside it the tiles every row sees whole need no mask at all;
only the tiles holding some row's `low` and the diagonal are masked. flex_attention evaluates its
mask function in every partial tile instead, and with GQA each query head reads its KV head itself
here too (the G heads of a group run next to each other, so the tile stays in L2).

Why a custom op and not flex_attention: traced into a compiled layer, flex_attention gets the q/k
RMSNorm and RoPE fused into it as a prologue that every (query tile, key tile) pair recomputes
(BENCHMARKS.md, issue 4.3), so the worker ran it outside the graph, breaking every layer in two. An
opaque op stays in the graph: one graph per layer, no breaks, and Inductor fuses around it.

Layout, the one transformers' attention modules hand over (no copies): q `[T, Hq, D]`, k and v
`[T, Hkv, D]` with the last dimension dense, any other strides; the output `[T, Hq, D]` contiguous.

Raw queries (`attend_rope_q`, TargetWorker's `rope_q`, off by default: slower on an H100): a Qwen3-style
layer hands the kernel its query projection before the head's RMSNorm and RoPE, and each program applies
them to its query tile as it loads it, once per tile (the key tiles, which many programs load, keep the
module's norm and RoPE). This is the prologue flex_attention had, done once per query tile instead of
once per (query tile, key tile) pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..batch import document_starts
from ..rope import apply_rope
from ..triton_launch import input_precision, key_value_tiles, last_dim_dense, launch, too_small

# (BLOCK_M query rows, BLOCK_N keys, warps, stages) per head_dim; BLOCK_N divides BLOCK_M (the kernel's
# diagonal starts at a key tile). Measured on the H200 for 128 at Qwen3-8B shapes (bench/doc_attn_tiles.py,
# GPU time of one layer, BENCHMARKS.md): 64 rows over 32 keys, 4 warps, 3 stages the fastest; 64 over 64
# next; 128-row tiles with 8 warps and flex_attention slower. The 4 query heads of a KV head in one
# program (32 positions x 4 heads, 8 warps): 0.106 ms a layer alone against 0.113, but no faster inside
# the 8B forward (67.66 / 67.22 against 67.05 / 67.56 ms, interleaved); tried in commit 4e8e445, not kept.
# 64 and 256 follow from it, unmeasured.
TILES = {64: (64, 32, 4, 3), 128: (64, 32, 4, 3), 256: (64, 32, 4, 3)}
# The shared memory the kernel asks for with TILES on GPUs below the H200's 227 KiB (sm_80, sm_120),
# rounded up: 24,576 / 53,248 / 102,400 B (bench/kernel_resources.py; tests/test_kernel_resources.py holds
# these bounds to those figures). A GPU with 99 KiB a block (sm_86, sm_89, sm_120) runs head_dim 256 on the
# fallback.
SHARED_BYTES = {64: 32 * 1024, 128: 64 * 1024, 256: 104 * 1024}
ATTN_NAME = "packed_triton_doc_attention"  # its name among transformers' attention functions (no "flash")
# Key/value tiles loaded through tensor descriptors (TMA), where the GPU has the copy engine for them
# (sm_90 and later) and the layout allows (16-byte aligned base and strides); None decides so, True or
# False forces it (tests run both paths in Triton's interpreter; benches compare them).
USE_TMA: bool | None = None


def unsupported(head_dim: int, dtype: torch.dtype, shared_bytes: int | None = None) -> str | None:
    """Why a target with these shapes cannot run the kernel (None: it can); `shared_bytes`: the GPU's
    shared memory a block may use (triton_launch.shared_memory), None when not known."""
    if head_dim not in TILES:
        return f"head_dim={head_dim} (the kernel has tiles for {', '.join(map(str, TILES))})"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dtype}"
    return too_small(shared_bytes, SHARED_BYTES[head_dim], f"the kernel's head_dim={head_dim} tiles")


@dataclass
class DocRows:
    """One packed row's visible key ranges for one layer kind (full or sliding), built once per row and
    passed to every layer of that kind as its `attention_mask`."""

    low: torch.Tensor  # [T] int32: the first key row i sees (it sees [low_i, i])
    order: torch.Tensor  # [ceil(T / BLOCK_M)] int32: query tiles, most keys first
    block_m: int  # the query tile the order was made for


def doc_rows(doc_ids: torch.Tensor, head_dim: int, window: int | None = None) -> DocRows:
    """The visible ranges of a packed row with document ids `doc_ids` [T] (padding, -1, is a document
    of its own, as the other masks have it). Fixed shapes, no host sync."""
    T = doc_ids.shape[0]
    block_m = TILES[head_dim][0]
    low = document_starts(doc_ids)
    if window:
        low = torch.maximum(low, torch.arange(T, device=doc_ids.device) - window + 1)
    starts = torch.arange(0, T, block_m, device=doc_ids.device)
    keys = torch.clamp(starts + block_m, max=T) - low[starts]
    return DocRows(low=low.to(torch.int32), order=torch.argsort(-keys, stable=True).to(torch.int32), block_m=block_m)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, low: torch.Tensor, order: torch.Tensor, scale: float,
            block_m: int, rope_q: tuple | None = None) -> torch.Tensor:
    """The kernel's launch. `rope_q` = (weight [D], eps, cos [T, D], sin [T, D]): q is the projection
    before its RMSNorm and RoPE, which the kernel applies as it loads each query tile."""
    T, hq, d = q.shape
    _, block_n, warps, stages = TILES[d]
    if block_m % block_n:
        raise ValueError(f"doc_attention tiles: BLOCK_N={block_n} must divide BLOCK_M={block_m} (doc_attn.TILES[{d}])")
    from .doc_attn_triton import doc_attn_fwd

    q, k, v = (last_dim_dense(x.to(q.dtype)) for x in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tma, kk, vv = key_value_tiles(USE_TMA, k, v, block_n)
    if rope_q is None:
        w, eps, cos, sin = q, 0.0, q, q  # not read
    else:
        w, eps, cos, sin = rope_q
        w, cos, sin = w.contiguous(), last_dim_dense(cos), last_dim_dense(sin.to(cos.dtype))
        if cos.shape != (T, d) or cos.stride() != sin.stride() or w.shape != (d,):
            raise ValueError(f"doc_attention's q RoPE: cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} and weight "
                             f"{tuple(w.shape)} must be [T, D] = {(T, d)} alike and [D]")
    launch(doc_attn_fwd, (hq, order.shape[0]),  # the G heads of a KV head side by side: its K/V tiles stay in L2
           (q, kk, vv, out, low, order, w, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), out.stride(0), out.stride(1), cos.stride(0), T, scale * math.log2(math.e), float(eps)),
           dict(G=hq // k.shape[1], D=d, BLOCK_M=block_m, BLOCK_N=block_n, PREC=input_precision(q), TMA=tma,
                ROPE_Q=rope_q is not None),
           warps, stages, q.device)
    return out


@torch.library.custom_op("dflash_mp::doc_attention", mutates_args=())
def doc_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, low: torch.Tensor, order: torch.Tensor,
                     scale: float, block_m: int) -> torch.Tensor:
    """`[T, Hq, D]`: row i of q attends to k/v rows [low_i, i] (GQA: Hq a multiple of k's heads)."""
    return _attend(q, k, v, low, order, scale, block_m)


@doc_attention_op.register_fake
def _(q, k, v, low, order, scale, block_m):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("dflash_mp::doc_attention_rope_q", mutates_args=())
def doc_attention_rope_q_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, low: torch.Tensor, order: torch.Tensor,
                            weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, scale: float,
                            block_m: int) -> torch.Tensor:
    """doc_attention_op of q's RMSNorm (`weight`, `eps`) and RoPE (`cos`/`sin` [T, D]), applied in the kernel."""
    return _attend(q, k, v, low, order, scale, block_m, (weight, eps, cos, sin))


@doc_attention_rope_q_op.register_fake
def _(q, k, v, low, order, weight, cos, sin, eps, scale, block_m):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: DocRows,
                  scale: float | None = None) -> torch.Tensor:
    """q `[T, Hq, D]`, k/v `[T, Hkv, D]` -> `[T, Hq, D]`, each row seeing its `rows` range."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return doc_attention_op(q, k, v, rows.low, rows.order, float(scale), rows.block_m)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      **kwargs):
    """The kernel called as transformers calls an attention function: query [1, Hq, T, D], key/value
    [1, Hkv, T, D], `attention_mask` the layer kind's DocRows (TargetWorker.masks; the window is in
    it already); returns ([1, T, Hq, D], None), as sdpa_attention_forward does. Traced into the
    compiled layer: the op is opaque to Inductor."""
    if not isinstance(attention_mask, DocRows):
        raise TypeError(f"{ATTN_NAME} takes the packed row's DocRows as its attention_mask (TargetWorker.masks), "
                        f"not {type(attention_mask).__name__}")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_NAME} takes one packed row: query {tuple(query.shape)}")
    if dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{ATTN_NAME} runs without dropout, softcap and attention sinks: use "
                         "target.attn_implementation=sdpa for this target.")
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D], the last dim dense
    return doc_attention(q, k, v, attention_mask, scale)[None], None


# The submodules of an attention module that normalizes each query and key head before RoPE (Qwen3's):
# such a layer can hand the kernel its query projection as it is (attend_rope_q).
ROPE_Q_ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"})
# The head sizes the kernel takes raw queries at: at 256 the norm and RoPE's tiles spill registers on
# sm_90 through pointers (bench/kernel_resources.py); Qwen3's heads are 128.
ROPE_Q_HEAD_DIMS = (64, 128)


def rope_q_unsupported(attn: nn.Module, head_dim: int, heads: int) -> str | None:
    """Why an attention module cannot run through attend_rope_q (None: its layout allows it). What its
    norm computes is not knowable from its layout: TargetWorker checks attend_rope_q against the
    module's own forward at load."""
    names = {n for n, _ in attn.named_children()}
    if names != ROPE_Q_ATTENTION:
        return f"its submodules are {sorted(names)}, not {sorted(ROPE_Q_ATTENTION)}"
    if getattr(attn.q_proj, "out_features", None) != heads * head_dim:  # e.g. a gated attention's q and gate
        return f"its q_proj gives {getattr(attn.q_proj, 'out_features', None)} features, not {heads} x {head_dim}"
    weight = getattr(attn.q_norm, "weight", None)
    if weight is None or tuple(weight.shape) != (head_dim,) or not hasattr(attn.q_norm, "variance_epsilon"):
        return "its q_norm is not Qwen3's RMSNorm over one head (a weight of head_dim, variance_epsilon)"
    if head_dim not in ROPE_Q_HEAD_DIMS:
        return f"head_dim={head_dim} (the kernel takes raw queries at {', '.join(map(str, ROPE_Q_HEAD_DIMS))})"
    return None


def attend_rope_q(attn: nn.Module, x: torch.Tensor, rows: DocRows, rope: tuple[torch.Tensor, torch.Tensor]
                  ) -> torch.Tensor:
    """What `attn(x, ...)[0]` computes for a Qwen3-style attention module (rope_q_unsupported), x
    [1, T, H], with the query heads' RMSNorm and RoPE inside the kernel: the kernel reads the query
    projection as it is, instead of a pass writing the normalized, rotated copy that it then reads
    (0.75 ms of the 8B forward, BENCHMARKS.md). Keys and values as the module computes them; `rope`
    the (cos, sin) tables [1, T, D] of the row's positions."""
    T, d = x.shape[1], attn.q_norm.weight.shape[0]
    cos, sin = rope[0][0], rope[1][0]
    if cos.shape[-1] != d:
        raise ValueError(f"attend_rope_q rotates whole heads: RoPE tables of {cos.shape[-1]} dims, heads of {d}")
    k = apply_rope(attn.k_norm(attn.k_proj(x).view(T, -1, d)), cos, sin)
    v = attn.v_proj(x).view(T, -1, d)
    q = attn.q_proj(x).view(T, -1, d)
    scale = getattr(attn, "scaling", d ** -0.5)
    o = doc_attention_rope_q_op(q, k, v, rows.low, rows.order, attn.q_norm.weight, cos, sin,
                                float(attn.q_norm.variance_epsilon), float(scale), rows.block_m)
    return attn.o_proj(o.view(1, T, -1))


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, attention_forward)
    return ATTN_NAME
