"""DFlash block attention in Triton (`drafter.attention=triton`): forward and backward kernels that
know the mask's shape instead of evaluating it per tile.

Layout, the one the drafter's projections produce (no transposes): q `[Q, Hq, D]` with Q = A*B block
tokens (block i owns rows i*B .. i*B+B-1); k and v `[T + Q, Hkv, D]`, the T context rows and then
the block tokens (attention.py's key layout).

What a block sees is two spans: the context rows `[start_i, end_i)` (its anchor's document before the
anchor, cut to the window on sliding layers) and its own B block keys. Every query row of block i in
one KV head's group (G = Hq/Hkv heads x B slots) shares that key set, so one program takes all
G*B of them as one tile and walks only keys someone in the tile sees: no masked-out tile is
visited, and GQA needs no repeat of K/V (the G heads' rows meet the same K/V tile in one matmul).

- forward, per (block, KV head): online softmax over the context span in tiles of BLOCK_N, then the
  B block keys; writes the output and the log-sum-exp (base 2) per row.
- backward 1, per (block, KV head): dQ over the same keys, and dK/dV of the block's own keys (no
  other block sees them); also D_i = rowsum(dO * O).
- backward 2, per (context tile, KV head): dK/dV of BLOCK_N2 context rows, summed over the blocks
  whose spans touch the tile. Valid anchors are sorted and their documents are contiguous spans,
  so span starts and ends both ascend and those blocks are one contiguous range `[lo, hi)`.

The forward's context tiles every row of its program sees whole skip the mask (`WHOLE_TILES`); the partial
tiles at a span's end and the blocks' own keys stay masked.

The forward and dQ may take two consecutive blocks' rows as one tile (`TILES["q_blocks"]`, where
2 x G*B fits in MAX_ROWS): the matmuls get twice the rows for each key/value tile loaded. Consecutive blocks of one document share their span's start; each row keeps to
its own block's span.

Programs run longest span first (`order`); the dK/dV kernel's over all KV heads (`HEADS_FIRST`), so
the long ones do not start in the last wave. On sm_90
and later the forward and dQ load their context tiles through tensor descriptors (TMA, `USE_TMA`), as
the target's doc_attn.py loads its key tiles.
Deterministic: no atomics. Triton is imported on first use; on CPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1), which the tests use against the dense mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..batch import document_starts
from ..triton_launch import input_precision, key_value_tiles, last_dim_dense, launch, too_small

# Tiles the sweeps at 8B drafter shapes picked (bench/flex_tiles.py; the figures are in BENCHMARKS.md, issue
# 31): the forward walks keys in tiles of BLOCK_N, dQ in tiles of DQ_BLOCK_N; the context dK/dV kernel owns
# BLOCK_N2 key rows per program. The forward and dQ take two blocks a program (128-row tiles, 8 warps):
# two blocks' rows share one load of each context tile where one block's filled a 64-row tile; dK/dV keeps
# one block, because two spill its four matmuls' 128 x 128 tiles, and walks a block's rows whole (in parts
# it spilled nothing and still ran slower). dQ over 128 keys with 3 stages needs more shared memory than
# an H200 has. Where two blocks' rows would pass MAX_ROWS (8 query heads per KV head: 128 rows a block),
# one block runs with these tiles, the same 128-row tiles (unmeasured at those shapes).
TILES = {"BLOCK_N": 64, "DQ_BLOCK_N": 64, "BLOCK_N2": 128, "fwd_warps": 8, "fwd_stages": 3, "dq_warps": 8,
         "dq_stages": 3, "dkv_warps": 8, "dkv_stages": 2, "q_blocks": 2}
# The most shared memory a block kernel asks for with TILES on GPUs below the H200's 227 KiB (sm_80,
# sm_120; fewer stages do not lower it there), by head_dim (16 and 32 as 64), rounded up: 77,824 B (64:
# dQ) and 132,116 B (128: the 70B drafter's dK/dV) (bench/kernel_resources.py; tests/test_kernel_resources.py
# holds these bounds to those figures). A GPU with 99 KiB a block (sm_86, sm_89, sm_120) runs head_dim 128
# on flex_attention under `auto`. At head_dim 256 the tiles ask for 263-460 KB even on the H200 (any stage
# count): refused.
SHARED_BYTES = {64: 80 * 1024, 128: 136 * 1024}
MAX_ROWS = 128  # rows per program (G*B, rounded up, x blocks) beyond which the tile would not fit in registers
# The forward's and dQ's context key/value tiles loaded through tensor descriptors (TMA), where the GPU
# has the copy engine for them (sm_90 and later) and the layout allows (16-byte aligned base and
# strides); None decides so, True or False forces it (tests run both paths in Triton's interpreter;
# benches compare them). The block's own keys and the dK/dV kernel load through pointers either way.
USE_TMA: bool | None = None
# The kernels ("fwd", "dq", "dkv") whose programs of all KV heads at one place in the kernel's order start
# together (the grid is (KV heads, places)), so the longest programs start first over all heads; the others
# start head by head ((places, KV heads)). The dK/dV kernel's 8 x T/BLOCK_N2 programs, about one an SM at
# 8B shapes, started head by head start the last heads' longest tiles after the first heads' shortest, and
# the last SM finishes late (bench/dkv_balance.py); heads first they spread. The forward and dQ launch
# ~2,000 programs of similar lengths, which spread either way, and dQ timed slower heads first, so they
# start head by head (BENCHMARKS.md, calls E1-E2).
# Read at each launch; outputs are the same bit for bit either way (no program depends on another's order).
KERNELS = ("fwd", "dq", "dkv")
HEADS_FIRST: frozenset[str] = frozenset({"dkv"})
# The forward's context tiles that every row of its program sees whole (inside all of its blocks' spans)
# skip the mask (the kernel's WHOLE), which timed faster. dQ and dK/dV split the same way (unmasked loops
# beside masked ones, two pipelines where there was one) timed slower, so they mask every tile
# (BENCHMARKS.md, call J1). False masks every forward tile too (benches compare the two). Read at each launch.
WHOLE_TILES = True


def _launch_order(kernel: str, places: int, kv_heads: int) -> tuple[tuple[int, int], dict]:
    """`kernel`'s launch grid for `places` programs in its order for each of `kv_heads` KV heads, and the
    kernel's HEADS_FIRST constexpr, which must read the grid's axes as they are laid out: both from one choice."""
    first = kernel in HEADS_FIRST
    return ((kv_heads, places) if first else (places, kv_heads)), dict(HEADS_FIRST=first)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def unsupported(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                shared_bytes: int | None = None) -> str | None:
    """Why these shapes cannot run the kernels (None: they can); `shared_bytes`: the GPU's shared memory
    a block may use (triton_launch.shared_memory), None when not known."""
    rows = _next_pow2(num_heads // num_kv_heads * block_size)
    if block_size < 16 or block_size & (block_size - 1):
        return f"block_size={block_size} (the kernels need a power of two >= 16)"
    if head_dim < 16 or head_dim & (head_dim - 1) or head_dim > 128:
        return (f"head_dim={head_dim} (the kernels need a power of two in [16, 128]; at 256 their tiles "
                "ask for more shared memory than a GPU has)")
    if rows > MAX_ROWS:
        return (f"{num_heads // num_kv_heads} query heads per KV head x block_size {block_size} = {rows} rows "
                f"> {MAX_ROWS}")
    return too_small(shared_bytes, SHARED_BYTES[max(64, head_dim)], f"their head_dim={head_dim} tiles")


def blocks_per_program(want: int, rows: int) -> int:
    """`want` (1 or 2) blocks' `rows` each in one program's tile, or 1 where two would pass MAX_ROWS."""
    if want not in (1, 2):
        raise ValueError(f"block_attn.TILES asks for {want} blocks per program; the kernels take 1 or 2")
    return want if want * rows <= MAX_ROWS else 1


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device` (CUDA with Triton, or Triton's CPU interpreter)."""
    from .ce_kernels import available as triton_available

    return triton_available(device)


@dataclass
class BlockSpans:
    """Per-step spans of one layer kind (full or sliding), shared by every layer of that kind."""

    start: torch.Tensor  # [A] int32: first context row block i sees (T for an invalid anchor)
    end: torch.Tensor  # [A] int32: one past its last (the anchor; T for an invalid anchor)
    anchor: torch.Tensor  # [A] int32: the anchor's position (the window's reference)
    order: torch.Tensor  # [A] int32: blocks, longest span first
    pair_order: torch.Tensor  # [ceil(A / 2)] int32: block pairs (2p, 2p + 1), most context rows first
    lo: torch.Tensor  # [ceil(T / BLOCK_N2)] int32: first block whose span touches context tile j
    hi: torch.Tensor  # [ceil(T / BLOCK_N2)] int32: one past the last
    tile_order: torch.Tensor  # [ceil(T / BLOCK_N2)] int32: context tiles, most blocks first
    block_size: int  # B
    window: int  # sliding window W, 0 on full-attention layers
    key_tile: int  # context rows per tile of `lo`/`hi` (the dK/dV kernel's BLOCK_N2)


def block_spans(anchors: torch.Tensor, valid: torch.Tensor, doc_ids: torch.Tensor, block_size: int,
                window: int | None = None, key_tile: int | None = None) -> BlockSpans:
    """The spans `make_mask_mod` describes, for one packed row. Fixed shapes, no host sync.

    Context row p is visible to slot k of block i iff start_i <= p < end_i and, with a window W,
    a_i + k - p < W. start_i is the anchor's document start (or a_i - W + 1 if later: slot 0's
    bound; later slots are cut inside the kernel)."""
    T = doc_ids.shape[0]
    key_tile = key_tile or TILES["BLOCK_N2"]
    start = document_starts(doc_ids)[anchors]
    if window:
        start = torch.maximum(start, anchors - window + 1)
    start = torch.where(valid, start, T)
    end = torch.where(valid, anchors, T)
    # Valid anchors ascend and come first, so `start` and `end` ascend over all A blocks.
    tiles = torch.arange(0, T, key_tile, device=doc_ids.device)
    lo = torch.searchsorted(end, tiles, right=True)  # first span ending after the tile's first row
    hi = torch.maximum(torch.searchsorted(start, tiles + key_tile), lo)  # first span starting past it
    i32 = torch.int32
    length = end - start
    pairs = torch.nn.functional.pad(length, (0, length.shape[0] % 2)).view(-1, 2).sum(1)
    return BlockSpans(
        start=start.to(i32), end=end.to(i32), anchor=anchors.to(i32),
        order=torch.argsort(-length, stable=True).to(i32), pair_order=torch.argsort(-pairs, stable=True).to(i32),
        lo=lo.to(i32), hi=hi.to(i32), tile_order=torch.argsort(lo - hi, stable=True).to(i32),
        block_size=block_size, window=int(window or 0), key_tile=key_tile)


def _kernels():
    from .block_attn_triton import block_attn_bwd_dkv, block_attn_bwd_dq, block_attn_fwd

    return block_attn_fwd, block_attn_bwd_dq, block_attn_bwd_dkv


def _shape(q: torch.Tensor, k: torch.Tensor, block_size: int) -> tuple[int, int, int, int, int, int]:
    """(T, A, Hkv, G, ROWS, D) of a call."""
    n_q, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    return k.shape[0] - n_q, n_q // block_size, hkv, g, _next_pow2(g * block_size), d


@torch.library.custom_op("dflash_mp::block_attention", mutates_args=())
def block_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                        anchor: torch.Tensor, order: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                        tile_order: torch.Tensor, block_size: int, window: int, scale: float,
                        key_tile: int, q_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out `[Q, Hq, D]`, lse); `order` lists the programs of `q_blocks` blocks each (BlockSpans' order
    or pair_order); `lo`, `hi`, `tile_order`, `key_tile` are the backward's."""
    q, k, v = (last_dim_dense(x.to(q.dtype)) for x in (q, k, v))
    T, A, hkv, g, rows, d = _shape(q, k, block_size)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(A * hkv * rows, dtype=torch.float32, device=q.device)
    fwd, _, _ = _kernels()
    tma, kd, vd = key_value_tiles(USE_TMA, k, v, TILES["BLOCK_N"])
    grid, heads = _launch_order("fwd", order.shape[0], hkv)
    launch(fwd, grid,
           (q, k, v, kd, vd, out, lse, start, end, anchor, order, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1), T, A, scale * math.log2(math.e)),
           dict(HKV=hkv, G=g, B=block_size, RB=rows, D=d, BLOCK_N=TILES["BLOCK_N"], WINDOW=window,
                PREC=input_precision(q), TMA=tma, NB=q_blocks, WHOLE=WHOLE_TILES, **heads),
           TILES["fwd_warps"], TILES["fwd_stages"], q.device)
    return out, lse


@block_attention_fwd.register_fake
def _(q, k, v, start, end, anchor, order, lo, hi, tile_order, block_size, window, scale, key_tile, q_blocks):
    T, A, hkv, g, rows, d = _shape(q, k, block_size)
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(A * hkv * rows, dtype=torch.float32)


@torch.library.custom_op("dflash_mp::block_attention_backward", mutates_args=())
def block_attention_bwd(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, start: torch.Tensor, end: torch.Tensor, anchor: torch.Tensor,
                        order: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, tile_order: torch.Tensor,
                        block_size: int, window: int, scale: float, key_tile: int, q_blocks: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's and k's shapes."""
    # Under autocast the incoming gradient may be fp32 while the saved tensors are bf16. q, k and v
    # contiguous (as the projections produce them): the kernels address dq, dk, dv with their strides.
    grad, out = (last_dim_dense(x.to(q.dtype)) for x in (grad, out))
    q, k, v = (x.to(q.dtype).contiguous() for x in (q, k, v))
    T, A, hkv, g, rows, d = _shape(q, k, block_size)
    dq, dk, dv = _grads_like(q, k, v)
    delta = torch.empty_like(lse)
    _, dq_kernel, dkv_kernel = _kernels()
    scale2 = scale * math.log2(math.e)
    common = dict(HKV=hkv, G=g, B=block_size, RB=rows, D=d, WINDOW=window, PREC=input_precision(q))
    tma, kd, vd = key_value_tiles(USE_TMA, k, v, TILES["DQ_BLOCK_N"])
    grid, heads = _launch_order("dq", order.shape[0], hkv)
    launch(dq_kernel, grid,
           (q, k, v, kd, vd, out, grad, lse, delta, dq, dk, dv, start, end, anchor, order, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), grad.stride(0),
            grad.stride(1), T, A, scale2, scale),
           dict(common, BLOCK_N=TILES["DQ_BLOCK_N"], TMA=tma, NB=q_blocks, **heads),
           TILES["dq_warps"], TILES["dq_stages"], q.device)
    grid, heads = _launch_order("dkv", lo.shape[0], hkv)
    launch(dkv_kernel, grid,
           (q, k, v, grad, lse, delta, dk, dv, start, end, anchor, lo, hi, tile_order, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad.stride(0), grad.stride(1), T, scale2, scale),
           dict(common, BLOCK_N2=key_tile, **heads), TILES["dkv_warps"], TILES["dkv_stages"], q.device)
    return dq, dk, dv


def _grads_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv: contiguous, in q's dtype (the kernels compute in it; the autograd formula casts dk and
    dv back to k's and v's, which differ from q's under autocast)."""
    return tuple(torch.empty(x.shape, dtype=q.dtype, device=q.device) for x in (q, k, v))


@block_attention_bwd.register_fake
def _(grad, q, k, v, out, lse, start, end, anchor, order, lo, hi, tile_order, block_size, window, scale, key_tile,
      q_blocks):
    return _grads_like(q, k, v)


def _setup_context(ctx, inputs, output):
    q, k, v, start, end, anchor, order, lo, hi, tile_order, block_size, window, scale, key_tile, q_blocks = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], start, end, anchor, order, lo, hi, tile_order)
    ctx.args = (block_size, window, scale, key_tile, q_blocks)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, start, end, anchor, order, lo, hi, tile_order = ctx.saved_tensors
    dq, dk, dv = block_attention_bwd(grad_out, q, k, v, out, lse, start, end, anchor, order, lo, hi, tile_order,
                                     *ctx.args)
    return (dq, dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 12


block_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: BlockSpans,
                    scale: float | None = None) -> torch.Tensor:
    """q `[Q, Hq, D]`, k/v `[T + Q, Hkv, D]` -> `[Q, Hq, D]`, the attention `make_mask_mod` describes."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    nb = blocks_per_program(TILES["q_blocks"], _shape(q, k, spans.block_size)[4])
    out, _ = block_attention_fwd(q, k, v, spans.start, spans.end, spans.anchor,
                                 spans.pair_order if nb == 2 else spans.order, spans.lo, spans.hi, spans.tile_order,
                                 spans.block_size, spans.window, scale, spans.key_tile, nb)
    return out
