"""The drafter's RMSNorm with its backward in one pass (`train.norm_kernel=triton`).

Compiled by Inductor, an RMSNorm's backward is two kernels over `[rows, H]`: one for dx (a reduction
along each row) and one for the weight's gradient (a reduction across rows), each reading x and the
incoming gradient. At the 8B drafter's shapes that was ~2 ms of the step on an H100 (BENCHMARKS.md).
Here the forward stays the module's own ops, so Inductor still fuses it with the residual add before
it; the backward is one custom op, whose Triton kernel reads x and the gradient once, writes dx and
keeps each program's share of the weight's gradient in fp32, summed over the programs after.

The arithmetic is autograd's for `weight * (x * rstd).to(dtype)` with rstd from x in fp32, taken in
fp32 throughout (autograd under bf16 rounds `gy * weight` and `gy * x_hat` to bf16 on the way; Inductor
does not). On CPU the op runs the same formula in PyTorch.
"""

from __future__ import annotations

import torch

from .. import triton_launch

NORM_KERNELS = ("triton", "autograd")


def available(device: torch.device) -> bool:
    """Whether the Triton kernel can run on `device` (CUDA with Triton, or Triton's CPU interpreter)."""
    return triton_launch.available(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rstd).to(x.dtype)`, rstd from x in fp32 (Qwen3's order of casts: exported weights
    give the same numbers in the public inference code). Casting the weight keeps the output in x's
    dtype under autocast with fp32 master weights (else q/k turn fp32 and v not)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * xf.to(dtype)


def backward_reference(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, the weight's gradient in its dtype): the kernel's arithmetic in PyTorch."""
    h = x.shape[-1]
    xf, gy = x.float(), grad.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = (xf * rstd).to(x.dtype).float()
    dw = (gy * x_hat).reshape(-1, h).sum(0)
    dn = gy * weight.float()
    dot = (dn * xf).sum(-1, keepdim=True)
    dx = dn * rstd - xf * (rstd.pow(3) * dot / h)
    return dx.to(x.dtype), dw.to(weight.dtype)


def _tiles(h: int) -> tuple[int, int, int]:
    """(rows a tile, columns a tile, warps): ~4096 values a tile, 8 warps for the hidden size's rows."""
    block_h = triton_next_pow2(h)
    block_r = max(1, min(64, 4096 // block_h))
    return block_r, block_h, 8 if block_h >= 2048 else 4


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _programs(device: torch.device, tiles: int) -> int:
    """A persistent grid: 4 programs an SM (64 in the interpreter), no more than the row tiles."""
    per = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 64
    return max(1, min(tiles, per))


@torch.library.custom_op("dflash_mp::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, the weight's gradient) of `rms_norm(x, weight, eps)` for the gradient `grad` of its output."""
    if not available(x.device):
        return backward_reference(grad, x, weight, eps)
    from .rms_norm_triton import rms_norm_bwd_kernel

    h = x.shape[-1]
    x2, g2 = x.reshape(-1, h).contiguous(), grad.reshape(-1, h).to(x.dtype).contiguous()
    rows = x2.shape[0]
    dx = torch.empty_like(x2)
    block_r, block_h, warps = _tiles(h)
    programs = _programs(x.device, -(-rows // block_r))
    part = torch.empty(programs, h, dtype=torch.float32, device=x.device)
    triton_launch.launch(rms_norm_bwd_kernel, (programs,), (x2, g2, weight, dx, part, rows, h, eps),
                         dict(BLOCK_R=block_r, BLOCK_H=block_h, ROUND=x.dtype != torch.float32), warps, 1, x.device)
    return dx.view(x.shape), part.sum(0).to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad, x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(grad, x, weight, ctx.eps)
        return dx, dw, None


def rms_norm_one_pass(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm`, whose backward is the one-pass op."""
    return _RMSNormFunction.apply(x, weight, eps)
