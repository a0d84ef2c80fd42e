"""The SwiGLU MLP's gate and up projections in one Triton GEMM (the target's forward), and for training
(the drafter's) its backward into both projections in the down projection's gradient GEMM. Both roles
keep them off: timed on an H100, these GEMMs fall short of cuBLAS's pace by more than the traffic they
save (BENCHMARKS.md, calls M1-M2).

A Llama-style MLP is `down(silu(x @ Wg^T) * (x @ Wu^T))`. Run as two cuBLAS GEMMs and a pointwise
kernel, the two GEMMs write 2 x M x N bf16 elements that the SwiGLU kernel reads back to write M x N:
at the 8B target's shapes (M = 3072 rows, N = 12288) 226 MB of traffic a layer on top of the GEMMs.
`swiglu` computes both products tile by tile in one kernel and applies the SwiGLU to its fp32
accumulators (swiglu_triton.py), so only h is written. The target has no backward, so nothing needs
the projections' outputs. A training forward would (its backward reads both): `swiglu_gu_op` also writes
them from the same accumulators, saving the read-back alone; bench/swiglu_gemm.py `--gate-up` times it
at a drafter's rows.

`swiglu_mlp` is the whole MLP for training: its forward is `swiglu_gu_op` and the down projection,
its backward computes dh = dy Wd in a Triton GEMM whose epilogue turns it into the gradients of both
projections (dg, du) from the saved g and u (`swiglu_bwd_op`), so dh is neither written nor read
back: 2 x M x N elements a layer saved in each direction. The rest (the weights' gradients, dx) are
cuBLAS GEMMs as in the model's own backward. bench/drafter_step.py's `+swiglu` runs the drafter's
MLPs through it.

Numerics: the GEMMs' outputs are not rounded to bf16 before the SwiGLU (the separate kernels round
them), so h differs from the separate path by bf16 rounding; its CUDA test holds it no farther from the
product in fp32 than the separate path.

The CPU path (no Triton) computes the same function in plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .triton_launch import available, descriptor, has_tma, launch, shared_memory

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, persistent) of the default tiles: two fp32
# accumulators of BLOCK_M x BLOCK_N (a 128 x 256 tile's registers with 8 warps) over 64-wide K steps,
# 48 KiB of shared memory a stage.
TILES = (128, 128, 64, 8, 8, 4, False)
# The shared memory a block asks for with TILES on sm_90, rounded up: 229,440 B (bench/kernel_resources.py;
# the epilogue's two fp32 accumulators go through shared memory, so fewer stages ask for the same).
SHARED_BYTES = 225 * 1024
# The backward GEMM's tiles (`swiglu_bwd_op`), in TILES' order. One fp32 accumulator, but the epilogue
# holds g, u and dh in fp32 at once: 128 x 256 tiles spill on sm_90 where 128 x 128 do not
# (bench/kernel_resources.py: 163,872 B of shared memory with 4 stages).
TILES_BWD = (128, 128, 64, 8, 8, 4, False)


def swiglu_reference(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    """silu(x @ wg^T) * (x @ wu^T) as the model's own modules compute it (two GEMMs, bf16 outputs)."""
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter: a few programs, to walk the persistent loop
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tiled_launch(kernel, tiles: list[int], M: int, N: int, device: torch.device, args: tuple,
                  **meta) -> None:
    """`kernel` over the tiles of an `[M, N]` output (TILES' order): one program a tile, or as many
    persistent programs as SMs walking them."""
    bm, bn, bk, group, warps, stages, persistent = tiles
    num_tiles = -(-M // bm) * -(-N // bn)
    grid = min(num_tiles, sm_count(device)) if persistent else num_tiles
    launch(kernel, (grid,), args,
           dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, FLATTEN=bool(persistent), **meta),
           warps, stages, device)


def _swiglu_launch(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, tiles: list[int],
                   store_gu: bool) -> list[torch.Tensor]:
    """[h] or, with `store_gu`, [h, x wg^T, x wu^T]: the kernel's outputs, each `[M, N]` in x's dtype."""
    bm, bn, bk = tiles[:3]
    M, K = x.shape
    N = wg.shape[0]
    x, wg, wu = (t.contiguous() for t in (x, wg, wu))
    outs = [torch.empty(M, N, dtype=x.dtype, device=x.device) for _ in range(3 if store_gu else 1)]
    from .swiglu_triton import swiglu_gemm

    h, *gu = (descriptor(o, [bm, bn]) for o in outs)
    g, u = gu or (h, h)  # unread without STORE_GU: h's descriptor stands in
    inputs = (descriptor(x, [bm, bk]), descriptor(wg, [bn, bk]), descriptor(wu, [bn, bk]))
    _tiled_launch(swiglu_gemm, tiles, M, N, x.device, (*inputs, h, g, u, M, N, K), STORE_GU=store_gu)
    return outs


@torch.library.custom_op("dflash_mp::swiglu", mutates_args=())
def swiglu_op(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, tiles: list[int]) -> torch.Tensor:
    """x `[M, K]`, wg and wu `[N, K]` (nn.Linear weights) -> `[M, N]`, silu(x wg^T) * (x wu^T)."""
    return _swiglu_launch(x, wg, wu, tiles, False)[0]


@swiglu_op.register_fake
def _(x, wg, wu, tiles):
    return x.new_empty(x.shape[0], wg.shape[0])


@torch.library.custom_op("dflash_mp::swiglu_gu", mutates_args=())
def swiglu_gu_op(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor,
                 tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swiglu_op` that also returns the projections x wg^T and x wu^T (what a training forward keeps for
    its backward), written by the same kernel from its accumulators. Not used by the target (no
    backward); bench/swiglu_gemm.py times it at a drafter's shapes."""
    h, g, u = _swiglu_launch(x, wg, wu, tiles, True)
    return h, g, u


@swiglu_gu_op.register_fake
def _(x, wg, wu, tiles):
    return tuple(x.new_empty(x.shape[0], wg.shape[0]) for _ in range(3))


def _swiglu_bwd_launch(dy: torch.Tensor, wd: torch.Tensor, g: torch.Tensor, u: torch.Tensor,
                       tiles: list[int]) -> list[torch.Tensor]:
    """[dg, du], each `[M, N]` like g: the gradients of silu(g) * u given dy `[M, K]` and the down
    projection's weight wd `[K, N]` (dh = dy wd, never written)."""
    bm, bn, bk = tiles[:3]
    M, K = dy.shape
    N = wd.shape[1]
    dy, wd, g, u = (t.contiguous() for t in (dy, wd, g, u))
    outs = [torch.empty(M, N, dtype=dy.dtype, device=dy.device) for _ in range(2)]
    from .swiglu_triton import swiglu_bwd_gemm

    tiles_mn = [descriptor(t, [bm, bn]) for t in (g, u, *outs)]
    _tiled_launch(swiglu_bwd_gemm, tiles, M, N, dy.device,
                  (descriptor(dy, [bm, bk]), descriptor(wd, [bk, bn]), *tiles_mn, M, N, K))
    return outs


@torch.library.custom_op("dflash_mp::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(dy: torch.Tensor, wd: torch.Tensor, g: torch.Tensor, u: torch.Tensor,
                  tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """dy `[M, K]`, wd `[K, N]` (the down projection's nn.Linear weight), g and u `[M, N]` (the gate and
    up projections' outputs) -> (dg, du): the gradients of down(silu(g) * u) with respect to g and u."""
    dg, du = _swiglu_bwd_launch(dy, wd, g, u, tiles)
    return dg, du


@swiglu_bwd_op.register_fake
def _(dy, wd, g, u, tiles):
    return torch.empty_like(g), torch.empty_like(u)


def swiglu_bwd_reference(dy: torch.Tensor, wd: torch.Tensor, g: torch.Tensor,
                         u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `swiglu_bwd_op` computes, in plain PyTorch (dh rounded to dy's dtype, as cuBLAS writes it)."""
    dh = (dy @ wd).float()
    gf, uf = g.float(), u.float()
    s = torch.sigmoid(gf)
    return (dh * uf * s * (1 + gf * (1 - s))).to(g.dtype), (dh * gf * s).to(u.dtype)


class _TrainedMLP(torch.autograd.Function):
    """down(silu(x wg^T) * (x wu^T)) on 2-D x through the two Triton GEMMs (the module docstring)."""

    @staticmethod
    def forward(ctx, x, wg, wu, wd, tiles, tiles_bwd):
        h, g, u = swiglu_gu_op(x, wg, wu, tiles)
        ctx.save_for_backward(x, wg, wu, wd, g, u, h)
        ctx.tiles_bwd = tiles_bwd
        return F.linear(h, wd)

    @staticmethod
    def backward(ctx, dy):
        x, wg, wu, wd, g, u, h = ctx.saved_tensors
        dg, du = swiglu_bwd_op(dy, wd, g, u, ctx.tiles_bwd)
        dx = torch.addmm(dg @ wg, du, wu)
        return dx, dg.t() @ x, du.t() @ x, dy.t() @ h, None, None


def swiglu_mlp(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor,
               tiles: tuple = TILES, tiles_bwd: tuple = TILES_BWD) -> torch.Tensor:
    """down(silu(x wg^T) * (x wu^T)) with wd the down projection's weight, differentiable: through the
    Triton GEMMs where they run (`fused_runs`, the weights in x's dtype), else the model's own ops."""
    if not fused_runs(x) or any(w.dtype != x.dtype for w in (wg, wu, wd)):
        return F.linear(swiglu_reference(x, wg, wu), wd)
    lead = x.shape[:-1]
    y = _TrainedMLP.apply(x.reshape(-1, x.shape[-1]), wg, wu, wd, [int(t) for t in tiles],
                          [int(t) for t in tiles_bwd])
    return y.view(*lead, wd.shape[0])


@torch.compiler.assume_constant_result
def device_runs(device: torch.device) -> bool:
    """Whether the Triton GEMMs run on `device`: a GPU with TMA and the shared memory for TILES (sm_90
    and sm_100), or Triton's interpreter. Asked while Dynamo traces a layer, it is answered then and
    kept as a constant: the device's properties come from a driver call Dynamo cannot trace."""
    if not available(device):
        return False
    if device.type != "cuda":
        return True
    have = shared_memory(device)
    return has_tma(device) and (have is None or have >= SHARED_BYTES)


def fused_runs(x: torch.Tensor) -> bool:
    """Whether the Triton GEMM runs for inputs like `x`: bf16 or fp16 rows of a multiple of 8 elements
    (16-byte tensor-descriptor strides) on a device where it runs (`device_runs`)."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.shape[-1] % 8 == 0 and device_runs(x.device)


def swiglu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, tiles: tuple = TILES) -> torch.Tensor:
    """silu(x @ wg^T) * (x @ wu^T) over x's last dimension: the Triton GEMM where it can run
    (`fused_runs`), else the reference."""
    if not fused_runs(x):
        return swiglu_reference(x, wg, wu)
    lead = x.shape[:-1]
    h = swiglu_op(x.reshape(-1, x.shape[-1]), wg, wu, [int(t) for t in tiles])
    return h.view(*lead, wg.shape[0])


def gated_silu(mlp: nn.Module) -> bool:
    """Whether `mlp` is a Llama-style MLP `down(silu(gate(x)) * up(x))` without biases (Qwen2/3, Mistral):
    what `mlp_forward` computes for it."""
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(mlp, "act_fn", None)
    return (set(n for n, _ in mlp.named_children()) == {"gate_proj", "up_proj", "down_proj", "act_fn"}
            and all(isinstance(p, nn.Linear) and p.bias is None for p in parts)
            and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"))


def mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A `gated_silu` MLP on x, its gate and up projections and the SwiGLU as one kernel (`swiglu`)."""
    return mlp.down_proj(swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight))
