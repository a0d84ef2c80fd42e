"""The Triton kernel behind model/rms_norm.py: an RMSNorm's backward, dx and the weight's gradient, in
one pass over x and the incoming gradient. Imported on first use (the CPU build of torch comes without
Triton)."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_bwd_kernel(X, GY, W, DX, DW_PART, rows, H, eps,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ROUND: tl.constexpr):
    """Rows `[rows, H]` of x and of the gradient, contiguous. Program p walks row tiles p, p + P, ...,
    writes their dx and adds `gy * x_hat` over its rows into DW_PART[p] (summed over programs after)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(pid * BLOCK_R, rows, programs * BLOCK_R):
        r_idx = start + tl.arange(0, BLOCK_R)
        mask = (r_idx < rows)[:, None] & cmask[None, :]
        offs = r_idx.to(tl.int64)[:, None] * H + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        gy = tl.load(GY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
        x_hat = x * rstd[:, None]
        if ROUND:  # the forward rounds x_hat to x's dtype before the weight scales it
            x_hat = x_hat.to(DX.dtype.element_ty).to(tl.float32)
        acc += tl.sum(gy * x_hat, axis=0)
        dn = gy * w[None, :]
        dot = tl.sum(dn * x, axis=1)
        dx = dn * rstd[:, None] - x * (rstd * rstd * rstd * dot / H)[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid.to(tl.int64) * H + cols, acc, mask=cmask)
