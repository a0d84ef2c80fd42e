"""flex_attention BlockMasks built from a `mask_mod`, compiled without a sort.

`torch.compile(create_block_mask)` lowers its two `argsort`s (tile rows into ordered column
indices) to Triton's sort network, whose cold compile on torch 2.11 takes minutes at some shapes: the
drafter's first step waited on it (BENCHMARKS.md, cold start). Here only the part that touches every
(query, key) pair is compiled: the `mask_mod` evaluated over the grid and summed per tile, fused into
two small reductions. The per-tile counts (`[Q/128, KV/128]`, a few thousand ints) are then ordered
by ATen's sort outside the graph, and `BlockMask.from_kv_blocks` does the rest, as create_block_mask
does. The result is the same BlockMask, tile for tile (tests/test_masks.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Compiled once per process, created on first use so importing this module does no CUDA work.
_compiled: dict[str, Callable] = {}


def compiled_once(name: str, fn: Callable) -> Callable:
    """`torch.compile(fn)`, one per `name` and process. Inside an outer compiled region Dynamo traces
    the raw function (a nested compiled wrapper would only add a frame to trace). New closures over
    same-shaped tensors (mask_mods) reuse the graph: their cells are graph inputs."""
    if torch.compiler.is_compiling():
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=False)
    return _compiled[name]


def mask_grid(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device | str) -> torch.Tensor:
    """`[Q, KV]` bool (a broadcast view where the mask_mod ignores queries or keys): the mask_mod evaluated
    once on broadcast index tensors (`[Q, 1]` queries, `[1, KV]` keys) and batch/head index 0, as every
    mask here ignores batch and head. The mask `create_mask` gives (tests/test_masks.py), without its
    per-element vmap and without the Dynamo import it makes (a second of a CPU drafter rank's start-up)."""
    zero = torch.zeros((), dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device)[:, None]
    kv = torch.arange(kv_len, device=device)[None, :]
    return mask_mod(zero, zero, q, kv).expand(q_len, kv_len)


def tile_counts(mask_mod: MaskMod, q_len: int, kv_len: int, q_block: int, kv_block: int,
                device: torch.device | str) -> torch.Tensor:
    """`[ceil(Q/q_block), ceil(KV/kv_block)]` int32: how many (query, key) pairs of each tile the
    mask lets through (`mask_grid`, summed per tile)."""
    seen = mask_grid(mask_mod, q_len, kv_len, device)
    # Ragged ends: padding rows and columns see nothing, so a ragged tile is never full.
    seen = F.pad(seen, (0, -kv_len % kv_block, 0, -q_len % q_block))
    qp, kvp = seen.shape
    per_row = seen.view(qp, kvp // kv_block, kv_block).sum(-1, dtype=torch.int32)
    return per_row.view(qp // q_block, q_block, kvp // kv_block).sum(1, dtype=torch.int32)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[R, C]` 0/1 tiles -> (`[1, 1, R]` count per row, `[1, 1, R, C]` the set columns first, in order)."""
    t = tiles.to(torch.int32)
    num = t.sum(-1, dtype=torch.int32)
    idx = torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None].contiguous(), idx[None, None].contiguous()


def build_block_mask(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device | str,
                     block_size: int | tuple[int, int] = 128, compiled: bool | None = None) -> BlockMask:
    """The BlockMask `create_block_mask(mask_mod, None, None, q_len, kv_len, device, block_size)`
    gives: tiles the mask fully covers are 'full' (the kernel skips the mask_mod there), tiles it
    partly covers are 'partial'. `compiled`: compile the tile counts (default: on CUDA)."""
    q_block, kv_block = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    device = torch.device(device)
    if compiled is None:
        compiled = device.type == "cuda"
    count = compiled_once("tile_counts", tile_counts) if compiled else tile_counts
    counts = count(mask_mod, q_len, kv_len, q_block, kv_block, device)
    full = counts == q_block * kv_block
    partial = (counts > 0) & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(q_block, kv_block),
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len))
