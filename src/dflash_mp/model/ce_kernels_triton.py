"""The Triton kernels of `ce_kernels.py` (imported on first use: the CPU build of torch has no Triton).
Module-level functions, so the jitted helper resolves in Triton's CPU interpreter too."""

import triton
import triton.language as tl


@triton.jit
def _store_row(base, row, labels, lse_out, ce_out, pred_out, lse, pred):
    """A row's statistics: its log-sum-exp, its CE against its label (whose logit is read here) and its argmax."""
    x_y = tl.load(base + tl.load(labels + row)).to(tl.float32)
    tl.store(lse_out + row, lse)
    tl.store(ce_out + row, lse - x_y)
    tl.store(pred_out + row, pred.to(tl.int64))


@triton.jit
def stats_tiles_kernel(logits, labels, lse_out, ce_out, pred_out, stride, V: tl.constexpr, BLOCK: tl.constexpr):
    """A row per program, each tile reduced across its threads (max, argmax, sum) into the row's state."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    cols = tl.arange(0, BLOCK)
    m = float("-inf")  # running maximum
    s = 0.0  # running sum of exp(x - m)
    best = float("-inf")  # the argmax's value and index (first occurrence)
    best_i = 0
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        tile_max = tl.max(x, axis=0)
        tile_i = tl.argmax(x, axis=0, tie_break_left=True)
        new_m = tl.maximum(m, tile_max)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
        better = tile_max > best  # strictly: an earlier tile keeps a tie
        best_i = tl.where(better, start + tile_i, best_i)
        best = tl.where(better, tile_max, best)
    _store_row(base, row, labels, lse_out, ce_out, pred_out, m + tl.log(s), best_i)


@triton.jit
def lanes_step(x, start, m, s, at, m_tile, TILE_MAX: tl.constexpr):
    """One tile `x` (logits start..start+BLOCK) into the per-lane state (see stats_lanes_kernel)."""
    # exp(t) as exp2(t * log2e): exp2 is one instruction where exp adds a range fix of three (exp2
    # flushes results below 2^-126 to 0, which no row's sum, at least 1, can see).
    log2e = 1.4426950408889634
    up = x > m  # strictly: a lane keeps the earlier index of a tie
    if TILE_MAX:
        new = tl.maximum(m_tile, tl.max(x, axis=0))
        s = s * tl.exp2((m_tile - new) * log2e) + tl.exp2((x - new) * log2e)
        m_tile = new
    else:
        # exp(-|x - m|) is the new term when x <= m and the old sum's rescale when x > m (the
        # new term is then exp(0)): one exp per logit where a plain online softmax takes two,
        # which would make the exp unit, not memory, the bound.
        e = tl.exp2(tl.abs(x - m) * -log2e)
        s = tl.where(up, s * e + 1.0, s + e)
    return tl.maximum(m, x), s, tl.where(up, start, at), m_tile


@triton.jit
def stats_lanes_kernel(logits, labels, lse_out, ce_out, pred_out, stride, V: tl.constexpr, BLOCK: tl.constexpr,
                       TILE_MAX: tl.constexpr, STAGES: tl.constexpr):
    """A row per program, each of BLOCK lanes with its own state over the row; lanes meet at the end."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    cols = tl.arange(0, BLOCK)
    # Maxima start at the lowest finite float, not -inf: `x - m` then never meets -inf - -inf
    # (NaN) on masked or all -inf lanes, with no test per logit.
    lowest = -3.4028234663852886e38
    m = tl.full([BLOCK], lowest, tl.float32)  # per lane: maximum so far
    s = tl.zeros([BLOCK], tl.float32)  # per lane: sum of exp(x - m), or of exp(x - m_tile) if TILE_MAX
    at = tl.zeros([BLOCK], tl.int32)  # per lane: start of the tile of its maximum's first occurrence
    m_tile = tl.full([], lowest, tl.float32)  # TILE_MAX: the row's maximum so far
    full = V - V % BLOCK
    # STAGES > 1: the next tiles' loads are in flight (through shared memory) while one is reduced.
    for start in tl.range(0, full, BLOCK, num_stages=STAGES):  # whole tiles, unmasked
        x = tl.load(base + start + cols).to(tl.float32)
        m, s, at, m_tile = lanes_step(x, start, m, s, at, m_tile, TILE_MAX)
    if full < V:
        idx = full + cols
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        m, s, at, m_tile = lanes_step(x, full, m, s, at, m_tile, TILE_MAX)
    row_max = tl.max(m, axis=0)
    if TILE_MAX:
        lse = m_tile + tl.log(tl.sum(s, axis=0))
    else:
        lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))
    # Each lane holds the first index of its own maximum; the smallest of those among the
    # lanes that reach the row's maximum is its first occurrence (torch.argmax's).
    pred = tl.min(tl.where(m == row_max, at + cols, V), axis=0)
    _store_row(base, row, labels, lse_out, ce_out, pred_out, lse, pred)


@triton.jit
def grad_kernel(logits, labels, lse_in, stride, V: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """TILES tiles of a row per program; the last program's span may run past V, its loop stops there."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    lse = tl.load(lse_in + row)
    y = tl.load(labels + row)
    first = tl.program_id(1) * (TILES * BLOCK)
    for start in range(first, tl.minimum(first + TILES * BLOCK, V), BLOCK):
        idx = start + tl.arange(0, BLOCK)
        keep = idx < V
        x = tl.load(base + idx, mask=keep, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - (idx == y).to(tl.float32)
        tl.store(base + idx, g.to(logits.dtype.element_ty), mask=keep)
