"""The Triton kernel of `doc_attn.py` (imported on first use: the CPU build of torch has no Triton).
Module-level functions, so the jitted helper resolves in Triton's CPU interpreter too. `PREC`: the
matmuls' input precision, "ieee" for fp32 inputs (an fp32 target stays fp32, not TF32). `TMA`: K and V
are tensor descriptors over `[T, Hkv, D]` (the copy engine of Hopper and later loads the key tiles,
out-of-range rows as zeros), else pointers."""

import triton
import triton.language as tl


@triton.jit
def _keys(acc, m, l, q, K, V, g, k_base, v_base, sk_t, sv_t, rows, low, n_lo, n_hi, T, scale2, D: tl.constexpr,
          BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over keys [n_lo, n_hi) in tiles of BLOCK_N. Unmasked tiles are seen whole by every
    row of the tile (the caller's bounds guarantee it): no mask, no bounds check, no empty rows."""
    d = tl.arange(0, D)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        if TMA:
            kt = tl.reshape(K.load([n0, g, 0]), [BLOCK_N, D])
            vt = tl.reshape(V.load([n0, g, 0]), [BLOCK_N, D])
        elif MASKED:
            ok = n < T
            kt = tl.load(K + k_base + n[:, None] * sk_t + d[None, :], mask=ok[:, None], other=0.0)
            vt = tl.load(V + v_base + n[:, None] * sv_t + d[None, :], mask=ok[:, None], other=0.0)
        else:
            kt = tl.load(K + k_base + n[:, None] * sk_t + d[None, :])
            vt = tl.load(V + v_base + n[:, None] * sv_t + d[None, :])
        s = tl.dot(q, tl.trans(kt), input_precision=PREC)  # unscaled: the scale rides in one FMA below
        if MASKED:
            vis = (n[None, :] >= low[:, None]) & (n[None, :] <= rows[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1) * scale2)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        else:
            m_new = tl.maximum(m, tl.max(s, 1) * scale2)
            m_use = m_new
        p = tl.exp2(s * scale2 - m_use[:, None])
        alpha = tl.exp2(m - m_use)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        m = m_new
    return acc, m, l


@triton.jit
def doc_attn_fwd(Q, K, V, O, LOW, ORDER, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, T, scale2,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 PREC: tl.constexpr, TMA: tl.constexpr):
    """Query head h (program axis 0), query tile ORDER[axis 1]: rows [m0, m0 + BLOCK_M), row i seeing
    keys [LOW[i], i]. Three key ranges: tiles some row sees only in part (masked), tiles every row sees
    whole (no mask), and the diagonal (masked)."""
    h = tl.program_id(0)
    m0 = tl.load(ORDER + tl.program_id(1)) * BLOCK_M
    g = h // G
    rows = m0 + tl.arange(0, BLOCK_M)
    live = rows < T
    d = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * sq_t + h * sq_h + d[None, :], mask=live[:, None], other=0.0)
    low = tl.load(LOW + rows, mask=live, other=0)
    last = tl.minimum(m0 + BLOCK_M, T) - 1
    lo = (tl.load(LOW + m0) // BLOCK_N) * BLOCK_N
    # Every row of the tile sees [its LOW, m0); the tile's largest LOW is its last row's (LOW ascends).
    whole = tl.minimum(tl.cdiv(tl.load(LOW + last), BLOCK_N) * BLOCK_N, m0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kb, vb = g * sk_h, g * sv_h
    acc, m, l = _keys(acc, m, l, q, K, V, g, kb, vb, sk_t, sv_t, rows, low, lo, whole, T, scale2, D, BLOCK_N, True,
                      PREC, TMA)
    acc, m, l = _keys(acc, m, l, q, K, V, g, kb, vb, sk_t, sv_t, rows, low, whole, m0, T, scale2, D, BLOCK_N, False,
                      PREC, TMA)
    acc, m, l = _keys(acc, m, l, q, K, V, g, kb, vb, sk_t, sv_t, rows, low, m0, last + 1, T, scale2, D, BLOCK_N,
                      True, PREC, TMA)
    out = acc / l[:, None]
    tl.store(O + rows[:, None] * so_t + h * so_h + d[None, :], out.to(O.dtype.element_ty), mask=live[:, None])
