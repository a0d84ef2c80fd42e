"""Training-time attention for DFlash blocks: one `mask_mod`, three backends.

Layout of one packed row: queries are the `A*B` block tokens (query `i*B + k` is slot `k` of block
`i`); keys are the `T` context positions followed by the same `A*B` block tokens. The same
`mask_mod` drives both backends, so the dense path (CPU, and the reference in tests) and the flex
path (CUDA) cannot drift apart:

- `dense`: the mask_mod on the index grid (`mask_grid`) -> boolean `[1, 1, Q, KV]` ->
  `scaled_dot_product_attention`.
- `flex`: `build_block_mask` -> `BlockMask` -> `flex_attention`, compiled once per process.
- `triton`: `block_spans` -> the context span of each block -> `block_attention` (block_attn.py),
  kernels that walk only the keys a block sees; tested against `dense` on the same `mask_mod`.

The `mask_mod` closes over tensors and per-run ints only (`T`, `B`, the window). A per-step Python
int in the closure would become a Dynamo guard and recompile every step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_mp.block_mask import build_block_mask, compiled_once, mask_grid
from dflash_mp.model.block_attn import BlockSpans, block_attention, block_spans
from dflash_mp.model.block_attn import available as block_kernels_available
from dflash_mp.options import resolve_auto

log = logging.getLogger(__name__)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
BACKENDS = ("auto", "dense", "flex", "triton")

# flex_attention backward tiles for DFlash block masks (blocks of 16 queries, head_dim 128), the fastest
# on the H200 (bench/flex_tiles.py; figures in BENCHMARKS.md): dK/dV walk 32-row query tiles per 64-row
# key tile, dQ 32-row key tiles per 64-row query tile, tiles that match the 16-query blocks better than
# Inductor's defaults (64/128/128/64, 8 warps). The forward keeps Inductor's tiles.
FLEX_KERNEL_OPTIONS = {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                       "bwd_num_warps": 4, "bwd_num_stages": 3}

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def make_mask_mod(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    doc_ids: torch.Tensor,
    seq_len: int,
    block_size: int,
    window: int | None,
) -> MaskMod:
    """Visibility of key `kv_idx` to block query `q_idx` (see module docstring for the layout).

    Context key p is visible to slot k of block i (anchor a) iff p is in a's document, p < a
    (the anchor's own hidden state does not exist yet at inference), and, for sliding layers,
    a + k - p < window. Block keys are visible only within the same block: all of them on full
    layers, slots j with j <= k and k - j < window on sliding layers. Invalid anchors see their
    own block and no context, so no softmax row is empty.
    """
    T, B = seq_len, block_size
    # Folding validity into the anchor's doc id (-2 never equals a real or padding doc id) keeps
    # one fewer tensor in the closure and one fewer load in the flex kernel.
    anchor_doc = torch.where(anchor_valid, doc_ids[anchors], torch.full_like(anchors, -2))

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // B
        slot = q_idx % B
        anchor = anchors[blk]
        is_ctx = kv_idx < T
        # Clamp so the gather stays in range for block keys; `is_ctx` discards those lanes.
        p = kv_idx.clamp(max=T - 1)
        doc_p = doc_ids[p]
        ctx_ok = is_ctx & (doc_p == anchor_doc[blk]) & (doc_p >= 0) & (p < anchor)
        # No clamp here: for context keys j < 0 and floor division gives a negative block, which
        # never equals `blk` (inductor's CPU codegen also fails on `clamp(...) // B`).
        j = kv_idx - T
        blk_ok = (~is_ctx) & (j // B == blk)
        if window is not None:
            ctx_ok = ctx_ok & (anchor + slot - p < window)
            # Causal inside the block; the window also applies here, as at inference (it only
            # bites when window < B).
            slot_j = j % B
            blk_ok = blk_ok & (slot_j <= slot) & (slot - slot_j < window)
        return ctx_ok | blk_ok

    return mask_mod


def resolve_backend(backend: str, device: torch.device | str, triton_unsupported: str | None = None) -> str:
    """`auto`: the Triton block kernels on CUDA where the drafter's shapes allow them
    (`triton_unsupported` is None), else flex; dense elsewhere (flex has no CPU backward)."""
    if torch.compiler.is_compiling() and backend in BACKENDS[1:]:
        return backend  # resolved and checked before the compile (DFlashObjective)
    device = torch.device(device)
    if backend == "auto" and device.type == "cuda":
        if triton_unsupported is not None:
            log.info("drafter attention: flex_attention; the Triton block kernels cannot run %s",
                     triton_unsupported)
        return "triton" if triton_unsupported is None and block_kernels_available(device) else "flex"
    resolved = resolve_auto("drafter.attention", backend, device, cuda="flex", cpu="dense", allowed=BACKENDS[1:])
    if resolved == "triton":
        if triton_unsupported is not None:
            raise ValueError(f"drafter.attention=triton cannot run {triton_unsupported}; use drafter.attention=flex "
                             "(or auto)")
        if not block_kernels_available(device):
            raise ValueError(f"drafter.attention=triton needs CUDA and the triton package (device {device}); use "
                             "drafter.attention=auto (dense sdpa on CPU)")
    return resolved


@dataclass
class BlockAttention:
    """Per-step masks for every layer kind in the drafter, built once and shared by all layers."""

    backend: str  # "dense", "flex" or "triton" (resolved, never "auto")
    full: torch.Tensor | BlockMask | BlockSpans | None  # mask for full-attention layers, None if there are none
    sliding: torch.Tensor | BlockMask | BlockSpans | None  # mask for sliding-window layers, None if none
    kernel_options: dict | None = None  # flex_attention's Inductor kernel options (tile sizes, ...)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding: bool) -> torch.Tensor:
        """q `[Q, Hq, D]`, k/v `[KV, Hkv, D]` (the projections' layout) -> `[Q, Hq, D]`."""
        mask = self.sliding if sliding else self.full
        assert mask is not None, "no mask was built for this layer kind"
        if self.backend == "triton":
            return block_attention(q, k, v, mask)
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        if self.backend == "dense":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            # The eager flex path is a slow math fallback; compiled is the only sensible CUDA path.
            fn = compiled_once("flex_attention", flex_attention) if q.is_cuda else flex_attention
            out = fn(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=self.kernel_options)
        return out[0].transpose(0, 1)


def build_block_attention(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    doc_ids: torch.Tensor,
    block_size: int,
    *,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    backend: str = "auto",
    flex_block_size: int | tuple[int, int] = 128,
    kernel_options: dict | None = None,
) -> BlockAttention:
    """Build the masks a step needs: one per layer kind present in `layer_types`.

    `flex_block_size` (one int, or (query, key) rows) is the BlockMask's tile; the flex kernel's
    tiles (`kernel_options`, e.g. `bwd_BLOCK_M1`) must divide it."""
    device = doc_ids.device
    backend = resolve_backend(backend, device)
    kinds = set(layer_types) if layer_types else {FULL_ATTENTION}
    T = doc_ids.shape[0]
    q_len = anchors.shape[0] * block_size
    kv_len = T + q_len

    def build(window: int | None):
        if backend == "triton":
            return block_spans(anchors, anchor_valid, doc_ids, block_size, window)
        mask_mod = make_mask_mod(anchors, anchor_valid, doc_ids, T, block_size, window)
        if backend == "dense":
            return mask_grid(mask_mod, q_len, kv_len, device)[None, None]
        size = flex_block_size if isinstance(flex_block_size, int) else tuple(flex_block_size)
        return build_block_mask(mask_mod, q_len, kv_len, device, size)

    if SLIDING_ATTENTION in kinds and sliding_window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is None; set it")
    full = build(None) if FULL_ATTENTION in kinds else None
    sliding = build(sliding_window) if SLIDING_ATTENTION in kinds else None
    return BlockAttention(backend=backend, full=full, sliding=sliding,
                          kernel_options=dict(kernel_options) if kernel_options else None)
