"""The Triton kernels of `block_attn.py` (imported on first use: the CPU build of torch has no Triton).
Module-level functions, so the jitted helpers resolve in Triton's CPU interpreter too. `PREC`: the
matmuls' input precision, "ieee" for fp32 inputs (fp32 training stays fp32, not TF32). `TMA`: KD and VD
are tensor descriptors over K and V (`[T + Q, Hkv, D]`, a box of BLOCK_N rows of one head) from which
the forward and dQ load their context tiles, else K and V again; the block's own keys and the dK/dV
kernel load through the pointers K and V either way.

`NB` blocks per program in the forward and dQ (1 or 2): a program's tile holds NB consecutive blocks'
rows, RB rows each (G*B rounded up to a power of two), so NB = 2 doubles the matmuls' row count and
halves the key/value tiles loaded per row. Two consecutive blocks of one document see spans with one start; of two
documents, disjoint spans, which the program walks one after the other (no key tile between them).

`WHOLE` (the forward's): context tiles that every row of the program sees whole (walk 1's tiles up to the
shortest of its rows' spans) skip the mask, the bounds check and the empty-row guard; the others are
masked. The masked and whole tiles' arithmetic is the same, so the results differ at most where the
compiler fuses a multiply and a subtraction differently (not at all in Triton's interpreter). Off on
sliding layers (WINDOW > 0), whose slots' windows cut every tile. dQ and dK/dV mask every tile: split
that way they ran slower (BENCHMARKS.md, call J1).

`HEADS_FIRST`: the grid is (KV heads, places in the order), so the GPU, which starts programs with
program_id(0) running fastest, starts every KV head's program of a place before the next place: the
programs start longest first over all heads. Else (places, KV heads): head by head, each longest first."""

import triton
import triton.language as tl


@triton.jit
def _rows(g, G: tl.constexpr, B: tl.constexpr, RB: tl.constexpr, NB: tl.constexpr):
    """Tile row r of KV head g: (r, its row within its block, the block's place in the program (0..NB-1),
    whether it is a real row, its slot, its query head)."""
    r = tl.arange(0, NB * RB)
    rr = r % RB
    return r, rr, r // RB, rr < G * B, rr % B, g * G + rr // B


@triton.jit
def _online(s, m, l, acc, v, vis, PREC: tl.constexpr, MASKED: tl.constexpr = True):
    """One key tile's update of the running max m, sum l and output acc (scores in base 2). Unmasked
    (`vis` unused), every row sees every key of the tile, so no row's max stays at -inf."""
    if MASKED:
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = m_new
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m - m_use)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _spans(START, END, ANCH, i0, i, live, A, T, NB: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
           WHOLE: tl.constexpr):
    """Per row: its block's span [start, end) and anchor; the program's walks [lo1, hi1), [lo2, hi2)
    over the context: one where its blocks' spans overlap (or NB = 1), two where they are disjoint; and
    `whole`: walk 1's tiles [lo1, whole) are seen whole by every row. Where the spans overlap they share
    their start (one document, no window), so those are the tiles inside the first block's span; where
    they are disjoint (or the second block is missing or invalid) the second block's rows see none of
    walk 1: no whole tiles."""
    srow = tl.load(START + i, mask=live, other=T)
    erow = tl.load(END + i, mask=live, other=T)
    arow = tl.load(ANCH + i, mask=live, other=0)
    lo1 = tl.load(START + i0)
    end1 = tl.load(END + i0)  # the first block's span's end
    hi1 = end1
    lo2 = hi1
    hi2 = hi1
    if NB == 2:
        has_b = i0 + 1 < A
        s_b = tl.load(START + i0 + 1, mask=has_b, other=T)
        e_b = tl.load(END + i0 + 1, mask=has_b, other=T)
        apart = s_b >= hi1  # valid anchors ascend, so start and end ascend: b never starts before a
        lo2 = tl.where(apart, s_b, hi1)
        hi2 = tl.where(apart, e_b, hi1)
        hi1 = tl.where(apart, hi1, tl.maximum(hi1, e_b))
    whole = lo1
    if WHOLE and WINDOW == 0:
        first_end = end1
        if NB == 2:
            first_end = tl.where(apart, lo1, end1)
        whole = lo1 + (first_end - lo1) // BLOCK_N * BLOCK_N
    return srow, erow, arow, lo1, hi1, lo2, hi2, whole


@triton.jit
def _key_tiles(K, V, KD, VD, n0, ok, g, d, sk_s, sk_h, sv_s, sv_h, D: tl.constexpr, BLOCK_N: tl.constexpr,
               TMA: tl.constexpr, MASKED: tl.constexpr):
    """K/V rows [n0, n0 + BLOCK_N) of KV head g: through descriptors, or through pointers with the rows
    where `ok` is False as zeros (MASKED; unmasked, every row is inside every span: no bounds check)."""
    if TMA:
        kt = tl.reshape(KD.load([n0, g, 0]), [BLOCK_N, D])
        vt = tl.reshape(VD.load([n0, g, 0]), [BLOCK_N, D])
    else:
        n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            kt = tl.load(K + n[:, None] * sk_s + g * sk_h + d[None, :], mask=ok[:, None], other=0.0)
            vt = tl.load(V + n[:, None] * sv_s + g * sv_h + d[None, :], mask=ok[:, None], other=0.0)
        else:
            kt = tl.load(K + n[:, None] * sk_s + g * sk_h + d[None, :])
            vt = tl.load(V + n[:, None] * sv_s + g * sv_h + d[None, :])
    return kt, vt


@triton.jit
def _context_keys(K, V, KD, VD, n0, hi, srow, erow, arow, g, slot, d, sk_s, sk_h, sv_s, sv_h, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, TMA: tl.constexpr, NB: tl.constexpr):
    """K/V rows [n0, n0 + BLOCK_N) of KV head g, cut at the walk's end `hi`, and which (row, key) pairs
    see them: each row its block's span, and on sliding layers the window of slot k's position a + k.
    Through descriptors, rows from `hi` on come as they are in the tensor (zeros only past its last
    row): `vis` keeps them out of every score, so their p is 0 in the forward and in dQ and nothing of
    them reaches a result."""
    n = n0 + tl.arange(0, BLOCK_N)
    ok = n < hi
    kt, vt = _key_tiles(K, V, KD, VD, n0, ok, g, d, sk_s, sk_h, sv_s, sv_h, D, BLOCK_N, TMA, True)
    if NB == 1:  # one block: its span is the walk
        vis = ok[None, :]
    else:
        vis = ok[None, :] & (n[None, :] >= srow[:, None]) & (n[None, :] < erow[:, None])
    if WINDOW > 0:
        vis = vis & (n[None, :] > arow[:, None] + slot[:, None] - WINDOW)
    return kt, vt, vis


@triton.jit
def _own_keys(K, V, T, A, i0, blk, g, slot, d, sk_s, sk_h, sv_s, sv_h, B: tl.constexpr, WINDOW: tl.constexpr,
              NB: tl.constexpr):
    """The program's blocks' own keys (rows T + i0*B .., B per block) of KV head g, whether each exists,
    and which (row, key) pairs see them: a block's rows all of its keys, or on sliding layers the causal
    ones within the window."""
    j = tl.arange(0, NB * B)
    jb = j // B
    jj = j % B
    nb = T + i0 * B + j
    there = i0 + jb < A
    kb = tl.load(K + nb[:, None] * sk_s + g * sk_h + d[None, :], mask=there[:, None], other=0.0)
    vb = tl.load(V + nb[:, None] * sv_s + g * sv_h + d[None, :], mask=there[:, None], other=0.0)
    vis = (jb[None, :] == blk[:, None]) & there[None, :]
    if WINDOW > 0:
        vis = vis & (jj[None, :] <= slot[:, None]) & (slot[:, None] - jj[None, :] < WINDOW)
    return nb, there, kb, vb, vis


@triton.jit
def _place_and_head(HEADS_FIRST: tl.constexpr):
    """This program's place in its kernel's order and its KV head (the grid's axes: HEADS_FIRST above)."""
    place = tl.program_id(0)
    g = tl.program_id(1)
    if HEADS_FIRST:
        place = tl.program_id(1)
        g = tl.program_id(0)
    return place, g


@triton.jit
def _program(ORDER, A, G: tl.constexpr, B: tl.constexpr, RB: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
             HEADS_FIRST: tl.constexpr):
    """The forward's and dQ's program: its first block i0 (NB x its place in ORDER), its KV head g, and
    per tile row (_rows) its block i, whether it is a live row, its query row and its query head; d
    the head dimension's lanes."""
    place, g = _place_and_head(HEADS_FIRST)
    i0 = tl.load(ORDER + place) * NB
    r, rr, blk, real, slot, head = _rows(g, G, B, RB, NB)
    i = i0 + blk
    return i0, g, rr, blk, slot, head, i, real & (i < A), i * B + slot, tl.arange(0, D)


@triton.jit
def block_attn_fwd(Q, K, V, KD, VD, O, LSE, START, END, ANCH, ORDER, sq_s, sq_h, sk_s, sk_h, sv_s, sv_h, so_s,
        so_h, T, A, scale2, HKV: tl.constexpr, G: tl.constexpr, B: tl.constexpr, RB: tl.constexpr,
        D: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
        NB: tl.constexpr, HEADS_FIRST: tl.constexpr, WHOLE: tl.constexpr):
    """Blocks i0 .. i0 + NB - 1 (i0 = NB x the program's place in ORDER), KV head g: output rows and
    their log-sum-exp (base 2)."""
    i0, g, rr, blk, slot, head, i, live, qrow, d = _program(ORDER, A, G, B, RB, D, NB, HEADS_FIRST)
    q = tl.load(Q + qrow[:, None] * sq_s + head[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
    srow, erow, arow, lo1, hi1, lo2, hi2, whole = _spans(START, END, ANCH, i0, i, live, A, T, NB, BLOCK_N, WINDOW,
                                                         WHOLE)
    m = tl.full([NB * RB], float("-inf"), tl.float32)
    l = tl.zeros([NB * RB], tl.float32)
    acc = tl.zeros([NB * RB, D], tl.float32)
    for n0 in range(lo1, whole, BLOCK_N):
        kt, vt = _key_tiles(K, V, KD, VD, n0, None, g, d, sk_s, sk_h, sv_s, sv_h, D, BLOCK_N, TMA, False)
        m, l, acc = _online(tl.dot(q, tl.trans(kt), input_precision=PREC) * scale2, m, l, acc, vt, None, PREC, False)
    for n0 in range(whole, hi1, BLOCK_N):
        kt, vt, vis = _context_keys(K, V, KD, VD, n0, hi1, srow, erow, arow, g, slot, d, sk_s, sk_h, sv_s, sv_h,
                                    D, BLOCK_N, WINDOW, TMA, NB)
        m, l, acc = _online(tl.dot(q, tl.trans(kt), input_precision=PREC) * scale2, m, l, acc, vt, vis, PREC)
    for n0 in range(lo2, hi2, BLOCK_N):
        kt, vt, vis = _context_keys(K, V, KD, VD, n0, hi2, srow, erow, arow, g, slot, d, sk_s, sk_h, sv_s, sv_h,
                                    D, BLOCK_N, WINDOW, TMA, NB)
        m, l, acc = _online(tl.dot(q, tl.trans(kt), input_precision=PREC) * scale2, m, l, acc, vt, vis, PREC)
    nb, there, kb, vb, vis = _own_keys(K, V, T, A, i0, blk, g, slot, d, sk_s, sk_h, sv_s, sv_h, B, WINDOW, NB)
    m, l, acc = _online(tl.dot(q, tl.trans(kb), input_precision=PREC) * scale2, m, l, acc, vb, vis, PREC)
    out = acc / l[:, None]
    tl.store(O + qrow[:, None] * so_s + head[:, None] * so_h + d[None, :], out.to(O.dtype.element_ty),
             mask=live[:, None])
    tl.store(LSE + (i * HKV + g) * RB + rr, m + tl.log2(l), mask=i < A)


@triton.jit
def _dq_tile(q, do, kt, vt, vis, lse, delta, dq, scale2, PREC: tl.constexpr):
    """One key tile's share of dQ, and its p and dS."""
    p = tl.where(vis, tl.exp2(tl.dot(q, tl.trans(kt), input_precision=PREC) * scale2 - lse[:, None]), 0.0)
    ds = p * (tl.dot(do, tl.trans(vt), input_precision=PREC) - delta[:, None])
    return dq + tl.dot(ds.to(kt.dtype), kt, input_precision=PREC), p, ds


@triton.jit
def block_attn_bwd_dq(Q, K, V, KD, VD, O, DO, LSE, DELTA, DQ, DK, DV, START, END, ANCH, ORDER, sq_s, sq_h,
           sk_s, sk_h, sv_s, sv_h, so_s, so_h, sdo_s, sdo_h, T, A, scale2, scale, HKV: tl.constexpr,
           G: tl.constexpr, B: tl.constexpr, RB: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
           WINDOW: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, NB: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """Blocks i0 .. i0 + NB - 1, KV head g: dQ of their rows, D = rowsum(dO * O) for bwd_dkv, and dK/dV of
    their own keys."""
    i0, g, rr, blk, slot, head, i, live, qrow, d = _program(ORDER, A, G, B, RB, D, NB, HEADS_FIRST)
    rows2d = live[:, None]
    q = tl.load(Q + qrow[:, None] * sq_s + head[:, None] * sq_h + d[None, :], mask=rows2d, other=0.0)
    do = tl.load(DO + qrow[:, None] * sdo_s + head[:, None] * sdo_h + d[None, :], mask=rows2d, other=0.0)
    o = tl.load(O + qrow[:, None] * so_s + head[:, None] * so_h + d[None, :], mask=rows2d, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (i * HKV + g) * RB + rr, delta, mask=i < A)
    lse = tl.load(LSE + (i * HKV + g) * RB + rr, mask=i < A, other=0.0)
    srow, erow, arow, lo1, hi1, lo2, hi2, _ = _spans(START, END, ANCH, i0, i, live, A, T, NB, BLOCK_N, WINDOW, False)
    dq = tl.zeros([NB * RB, D], tl.float32)
    for n0 in range(lo1, hi1, BLOCK_N):
        kt, vt, vis = _context_keys(K, V, KD, VD, n0, hi1, srow, erow, arow, g, slot, d, sk_s, sk_h, sv_s, sv_h,
                                    D, BLOCK_N, WINDOW, TMA, NB)
        dq, p, ds = _dq_tile(q, do, kt, vt, vis, lse, delta, dq, scale2, PREC)
    for n0 in range(lo2, hi2, BLOCK_N):
        kt, vt, vis = _context_keys(K, V, KD, VD, n0, hi2, srow, erow, arow, g, slot, d, sk_s, sk_h, sv_s, sv_h,
                                    D, BLOCK_N, WINDOW, TMA, NB)
        dq, p, ds = _dq_tile(q, do, kt, vt, vis, lse, delta, dq, scale2, PREC)
    nb, there, kb, vb, vis = _own_keys(K, V, T, A, i0, blk, g, slot, d, sk_s, sk_h, sv_s, sv_h, B, WINDOW, NB)
    dq, p, ds = _dq_tile(q, do, kb, vb, vis, lse, delta, dq, scale2, PREC)
    # The blocks' own keys: only their block's rows see them, and the G heads' rows sum in the matmul.
    dvb = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
    dkb = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC) * scale
    tl.store(DK + nb[:, None] * sk_s + g * sk_h + d[None, :], dkb.to(DK.dtype.element_ty), mask=there[:, None])
    tl.store(DV + nb[:, None] * sv_s + g * sv_h + d[None, :], dvb.to(DV.dtype.element_ty), mask=there[:, None])
    tl.store(DQ + qrow[:, None] * sq_s + head[:, None] * sq_h + d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=rows2d)


@triton.jit
def block_attn_bwd_dkv(Q, K, V, DO, LSE, DELTA, DK, DV, START, END, ANCH, LO, HI, TORDER, sq_s, sq_h, sk_s, sk_h,
            sv_s, sv_h, sdo_s, sdo_h, T, scale2, scale, HKV: tl.constexpr, G: tl.constexpr, B: tl.constexpr,
            RB: tl.constexpr, D: tl.constexpr, BLOCK_N2: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr,
            HEADS_FIRST: tl.constexpr):
    """Context tile t (the program's place in TORDER), KV head g: dK/dV of its rows over blocks [lo, hi),
    one block's rows at a time (two at a time, tried, spilled its 128 x 128 tiles: BENCHMARKS.md)."""
    place, g = _place_and_head(HEADS_FIRST)
    t = tl.load(TORDER + place)
    r, _, _, live, slot, head = _rows(g, G, B, RB, 1)
    d = tl.arange(0, D)
    n = t * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    in_t = n < T
    kt = tl.load(K + n[:, None] * sk_s + g * sk_h + d[None, :], mask=in_t[:, None], other=0.0)
    vt = tl.load(V + n[:, None] * sv_s + g * sv_h + d[None, :], mask=in_t[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N2, D], tl.float32)
    dv = tl.zeros([BLOCK_N2, D], tl.float32)
    lo = tl.load(LO + t)
    hi = tl.load(HI + t)
    for i in range(lo, hi):
        qrow = i * B + slot
        q = tl.load(Q + qrow[:, None] * sq_s + head[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
        do = tl.load(DO + qrow[:, None] * sdo_s + head[:, None] * sdo_h + d[None, :], mask=live[:, None],
                     other=0.0)
        lse = tl.load(LSE + (i * HKV + g) * RB + r)
        delta = tl.load(DELTA + (i * HKV + g) * RB + r)
        start = tl.load(START + i)
        end = tl.load(END + i)
        vis = ((n >= start) & (n < end))[:, None] & live[None, :]
        if WINDOW > 0:
            a = tl.load(ANCH + i)
            vis = vis & (n[:, None] > a + slot[None, :] - WINDOW)
        pt = tl.where(vis, tl.exp2(tl.dot(kt, tl.trans(q), input_precision=PREC) * scale2 - lse[None, :]), 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
        dst = pt * (tl.dot(vt, tl.trans(do), input_precision=PREC) - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    tl.store(DK + n[:, None] * sk_s + g * sk_h + d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=in_t[:, None])
    tl.store(DV + n[:, None] * sv_s + g * sv_h + d[None, :], dv.to(DV.dtype.element_ty), mask=in_t[:, None])
