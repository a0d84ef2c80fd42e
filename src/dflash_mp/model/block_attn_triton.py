"""The Triton kernels of `block_attn.py` (imported on first use: the CPU build of torch has no Triton).
Module-level functions, so the jitted helpers resolve in Triton's CPU interpreter too. `PREC`: the
matmuls' input precision, "ieee" for fp32 inputs (fp32 training stays fp32, not TF32). `TMA`: KD and VD
are tensor descriptors over K and V (`[T + Q, Hkv, D]`, a box of BLOCK_N rows of one head) from which
the forward and dQ load their context tiles, else K and V again; the block's own keys and the dK/dV
kernel load through the pointers K and V either way."""

import triton
import triton.language as tl


@triton.jit
def _rows(g, G: tl.constexpr, B: tl.constexpr, ROWS: tl.constexpr):
    """Tile row r of KV head g: (r, whether it is a real row, its slot, its query head)."""
    r = tl.arange(0, ROWS)
    return r, r < G * B, r % B, g * G + r // B


@triton.jit
def _online(s, m, l, acc, v, vis, PREC: tl.constexpr):
    """One key tile's update of the running max m, sum l and output acc (scores in base 2)."""
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m - m_use)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _context_keys(K, V, KD, VD, n0, end, a, g, slot, d, sk_s, sk_h, sv_s, sv_h, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, TMA: tl.constexpr):
    """K/V rows [n0, n0 + BLOCK_N) of KV head g and which (slot, key) pairs see them: rows up to `end`,
    and on sliding layers within the window of slot k's position a + k. Through descriptors, rows from
    `end` on come as they are in the tensor (zeros only past its last row): `vis` keeps them out of
    every score, so their p is 0 in the forward and in dQ and nothing of them reaches a result."""
    n = n0 + tl.arange(0, BLOCK_N)
    ok = n < end
    if TMA:
        kt = tl.reshape(KD.load([n0, g, 0]), [BLOCK_N, D])
        vt = tl.reshape(VD.load([n0, g, 0]), [BLOCK_N, D])
    else:
        kt = tl.load(K + n[:, None] * sk_s + g * sk_h + d[None, :], mask=ok[:, None], other=0.0)
        vt = tl.load(V + n[:, None] * sv_s + g * sv_h + d[None, :], mask=ok[:, None], other=0.0)
    vis = ok[None, :]
    if WINDOW > 0:
        vis = vis & (n[None, :] > a + slot[:, None] - WINDOW)
    return kt, vt, vis


@triton.jit
def _own_keys(K, V, T, i, g, slot, d, sk_s, sk_h, sv_s, sv_h, B: tl.constexpr, WINDOW: tl.constexpr):
    """Block i's own B keys (rows T + i*B ..) of KV head g, and which (slot, key) pairs see them: all of
    them, or on sliding layers the causal ones within the window."""
    j = tl.arange(0, B)
    nb = T + i * B + j
    kb = tl.load(K + nb[:, None] * sk_s + g * sk_h + d[None, :])
    vb = tl.load(V + nb[:, None] * sv_s + g * sv_h + d[None, :])
    vis = j[None, :] < B
    if WINDOW > 0:
        vis = (j[None, :] <= slot[:, None]) & (slot[:, None] - j[None, :] < WINDOW)
    return nb, kb, vb, vis


@triton.jit
def block_attn_fwd(Q, K, V, KD, VD, O, LSE, START, END, ANCH, ORDER, sq_s, sq_h, sk_s, sk_h, sv_s, sv_h, so_s,
        so_h, T, scale2, HKV: tl.constexpr, G: tl.constexpr, B: tl.constexpr, ROWS: tl.constexpr,
        D: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """Block i (the program's place in ORDER), KV head g: output rows and their log-sum-exp (base 2)."""
    i = tl.load(ORDER + tl.program_id(0))
    g = tl.program_id(1)
    r, live, slot, head = _rows(g, G, B, ROWS)
    qrow = i * B + slot
    d = tl.arange(0, D)
    q = tl.load(Q + qrow[:, None] * sq_s + head[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
    start = tl.load(START + i)
    end = tl.load(END + i)
    a = tl.load(ANCH + i)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        kt, vt, vis = _context_keys(K, V, KD, VD, n0, end, a, g, slot, d, sk_s, sk_h, sv_s, sv_h, D, BLOCK_N,
                                    WINDOW, TMA)
        m, l, acc = _online(tl.dot(q, tl.trans(kt), input_precision=PREC) * scale2, m, l, acc, vt, vis, PREC)
    nb, kb, vb, vis = _own_keys(K, V, T, i, g, slot, d, sk_s, sk_h, sv_s, sv_h, B, WINDOW)
    m, l, acc = _online(tl.dot(q, tl.trans(kb), input_precision=PREC) * scale2, m, l, acc, vb, vis, PREC)
    out = acc / l[:, None]
    tl.store(O + qrow[:, None] * so_s + head[:, None] * so_h + d[None, :], out.to(O.dtype.element_ty),
             mask=live[:, None])
    tl.store(LSE + (i * HKV + g) * ROWS + r, m + tl.log2(l))


@triton.jit
def block_attn_bwd_dq(Q, K, V, KD, VD, O, DO, LSE, DELTA, DQ, DK, DV, START, END, ANCH, ORDER, sq_s, sq_h,
           sk_s, sk_h, sv_s, sv_h, so_s, so_h, sdo_s, sdo_h, T, scale2, scale, HKV: tl.constexpr,
           G: tl.constexpr, B: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
           WINDOW: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """Block i, KV head g: dQ of its rows, D = rowsum(dO * O) for bwd_dkv, and dK/dV of its own B keys."""
    i = tl.load(ORDER + tl.program_id(0))
    g = tl.program_id(1)
    r, live, slot, head = _rows(g, G, B, ROWS)
    qrow = i * B + slot
    d = tl.arange(0, D)
    rows2d = live[:, None]
    q = tl.load(Q + qrow[:, None] * sq_s + head[:, None] * sq_h + d[None, :], mask=rows2d, other=0.0)
    do = tl.load(DO + qrow[:, None] * sdo_s + head[:, None] * sdo_h + d[None, :], mask=rows2d, other=0.0)
    o = tl.load(O + qrow[:, None] * so_s + head[:, None] * so_h + d[None, :], mask=rows2d, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (i * HKV + g) * ROWS + r, delta)
    lse = tl.load(LSE + (i * HKV + g) * ROWS + r)
    start = tl.load(START + i)
    end = tl.load(END + i)
    a = tl.load(ANCH + i)
    dq = tl.zeros([ROWS, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        kt, vt, vis = _context_keys(K, V, KD, VD, n0, end, a, g, slot, d, sk_s, sk_h, sv_s, sv_h, D, BLOCK_N,
                                    WINDOW, TMA)
        p = tl.where(vis, tl.exp2(tl.dot(q, tl.trans(kt), input_precision=PREC) * scale2 - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(vt), input_precision=PREC) - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), kt, input_precision=PREC)
    nb, kb, vb, vis = _own_keys(K, V, T, i, g, slot, d, sk_s, sk_h, sv_s, sv_h, B, WINDOW)
    p = tl.where(vis, tl.exp2(tl.dot(q, tl.trans(kb), input_precision=PREC) * scale2 - lse[:, None]), 0.0)
    ds = p * (tl.dot(do, tl.trans(vb), input_precision=PREC) - delta[:, None])
    dq += tl.dot(ds.to(kb.dtype), kb, input_precision=PREC)
    # The block's own keys: only its rows see them, and the G heads' rows sum in the matmul.
    dvb = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
    dkb = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC) * scale
    tl.store(DK + nb[:, None] * sk_s + g * sk_h + d[None, :], dkb.to(DK.dtype.element_ty))
    tl.store(DV + nb[:, None] * sv_s + g * sv_h + d[None, :], dvb.to(DV.dtype.element_ty))
    tl.store(DQ + qrow[:, None] * sq_s + head[:, None] * sq_h + d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=rows2d)


@triton.jit
def block_attn_bwd_dkv(Q, K, V, DO, LSE, DELTA, DK, DV, START, END, ANCH, LO, HI, TORDER, sq_s, sq_h, sk_s, sk_h,
            sv_s, sv_h, sdo_s, sdo_h, T, scale2, scale, HKV: tl.constexpr, G: tl.constexpr, B: tl.constexpr,
            ROWS: tl.constexpr, D: tl.constexpr, BLOCK_N2: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr):
    """Context tile t (the program's place in TORDER), KV head g: dK/dV of its rows over blocks [lo, hi)."""
    t = tl.load(TORDER + tl.program_id(0))
    g = tl.program_id(1)
    r, live, slot, head = _rows(g, G, B, ROWS)
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
        lse = tl.load(LSE + (i * HKV + g) * ROWS + r)
        delta = tl.load(DELTA + (i * HKV + g) * ROWS + r)
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
