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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..batch import document_starts
from ..triton_launch import input_precision, key_value_tiles, last_dim_dense, launch, too_small

# (BLOCK_M query rows, BLOCK_N keys, warps, stages) per head_dim; BLOCK_N divides BLOCK_M (the kernel's
# diagonal starts at a key tile). Swept on the H200 for 128 at Qwen3-8B shapes (bench/doc_attn_tiles.py,
# GPU time of one layer; figures in BENCHMARKS.md): 64 rows over 32 keys, 4 warps, 3 stages the fastest;
# 64 over 64 next; 128-row tiles with 8 warps and flex_attention slower. The 4 query heads of a KV head in
# one program was faster alone but no faster inside the 8B forward (call Z1); tried in commit 4e8e445, not
# kept. 64 and 256 follow from it, unmeasured.
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


@torch.library.custom_op("dflash_mp::doc_attention", mutates_args=())
def doc_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, low: torch.Tensor, order: torch.Tensor,
                     scale: float, block_m: int) -> torch.Tensor:
    """`[T, Hq, D]`: row i of q attends to k/v rows [low_i, i] (GQA: Hq a multiple of k's heads)."""
    T, hq, d = q.shape
    _, block_n, warps, stages = TILES[d]
    if block_m % block_n:
        raise ValueError(f"doc_attention tiles: BLOCK_N={block_n} must divide BLOCK_M={block_m} (doc_attn.TILES[{d}])")
    from .doc_attn_triton import doc_attn_fwd

    q, k, v = (last_dim_dense(x.to(q.dtype)) for x in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tma, kk, vv = key_value_tiles(USE_TMA, k, v, block_n)
    launch(doc_attn_fwd, (hq, order.shape[0]),  # the G heads of a KV head side by side: its K/V tiles stay in L2
           (q, kk, vv, out, low, order, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), T, scale * math.log2(math.e)),
           dict(G=hq // k.shape[1], D=d, BLOCK_M=block_m, BLOCK_N=block_n, PREC=input_precision(q), TMA=tma),
           warps, stages, q.device)
    return out


@doc_attention_op.register_fake
def _(q, k, v, low, order, scale, block_m):
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


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, attention_forward)
    return ATTN_NAME
