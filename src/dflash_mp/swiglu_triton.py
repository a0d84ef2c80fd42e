"""The Triton kernels of `swiglu.py` (imported on first use: the CPU build of torch has no Triton).

`swiglu_gemm` computes h = silu(x @ Wg^T) * (x @ Wu^T) for one tile of h at a time: both products
accumulate in fp32 side by side over the same tiles of x, and the SwiGLU is the epilogue. The gate
and up projections' outputs are not written (the separate GEMMs write 2 x M x N elements that a
SwiGLU kernel reads back to write M x N), unless STORE_GU asks for them (a training forward, whose
backward needs them): then the kernel writes them from its accumulators, and the read-back is still
saved. `swiglu_bwd_gemm` is the training backward's GEMM, dh = dy @ Wd with the SwiGLU's gradient as
its epilogue. Tiles come through tensor descriptors (TMA on Hopper and later). The programs walk the M x N
tiles in strides of their number (as many as tiles: one tile a program; as many as SMs: persistent
programs), grouped GROUP_M tile rows at a time so that the weight tiles a group reads stay in L2."""

import triton
import triton.language as tl


@triton.jit
def _tile_origin(tile, num_m, num_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The first row and column of output tile `tile`, walked GROUP_M tile rows at a time."""
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    rows = min(num_m - first_m, GROUP_M)
    return (first_m + (tile % in_group) % rows) * BLOCK_M, ((tile % in_group) // rows) * BLOCK_N


@triton.jit
def swiglu_gemm(X, WG, WU, H, G, U, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, STORE_GU: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        m0, n0 = _tile_origin(tile, num_m, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = X.load([m0, k0])
            gate = tl.dot(x, tl.trans(WG.load([n0, k0])), gate)
            up = tl.dot(x, tl.trans(WU.load([n0, k0])), up)
        h = gate * tl.sigmoid(gate) * up
        H.store([m0, n0], h.to(X.dtype))
        if STORE_GU:  # a training forward: the backward needs both projections
            G.store([m0, n0], gate.to(X.dtype))
            U.store([m0, n0], up.to(X.dtype))


@triton.jit
def swiglu_bwd_gemm(DY, WD, G, U, DG, DU, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    """The backward of down(silu(g) * u) into g and u: dh = dy @ Wd (Wd: the down projection's weight,
    `[K, N]`), then dg = dh * u * silu'(g) and du = dh * silu(g) from the fp32 accumulator. dh itself
    is never written (the separate path writes it and a SwiGLU-backward kernel reads it back)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        m0, n0 = _tile_origin(tile, num_m, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        dh = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            dh = tl.dot(DY.load([m0, k0]), WD.load([k0, n0]), dh)
        g = G.load([m0, n0]).to(tl.float32)
        u = U.load([m0, n0]).to(tl.float32)
        s = tl.sigmoid(g)
        DU.store([m0, n0], (dh * g * s).to(DY.dtype))
        DG.store([m0, n0], (dh * u * s * (1.0 + g * (1.0 - s))).to(DY.dtype))
