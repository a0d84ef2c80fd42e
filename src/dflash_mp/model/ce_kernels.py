"""Triton kernels for the fused CE over the frozen LM head: one pass over each row of logits for
the softmax statistics, one for the gradient.

Per chunk of R rows the logits `[R, V]` come from cuBLAS in the head's dtype. `ce_stats` reads
them once and returns the log-sum-exp, the CE against the labels and the argmax, keeping the
running maximum and sum per row (the online softmax) in registers. `softmax_grad_` then
overwrites the logits with `softmax - onehot(label)`, the gradient w.r.t. the logits, in place:
one read and one write, and no second `[R, V]` buffer. Inductor's fused chunk (the `inductor`
loss kernel) reads the logits three times and writes the gradient once.

The arithmetic is the PyTorch chunk's: logits promoted to fp32, `lse = max + log(sum(exp(x -
max)))`, first index of the maximum for the argmax. Triton is imported on first use, so the
module loads where only the CPU build of torch is installed.
"""

from __future__ import annotations

import functools

import torch

from .. import triton_launch

BLOCK_V = 4096  # logits per tile: 8 KiB of bf16 per row and iteration
STATS_WARPS = 4  # warps per row of the statistics pass (4: 0.81 ms for both passes of a 4096-row
#   chunk on the H200, 16: 1.18, Inductor's chunk: 1.64; bench/ce_chunk.py)
GRAD_WARPS = 8  # warps per tile of the gradient pass


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device` (CUDA with Triton, or Triton's CPU interpreter)."""
    return triton_launch.available(device)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def stats_kernel(logits, labels, lse_out, ce_out, pred_out, stride, V: tl.constexpr, BLOCK: tl.constexpr):
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
        lse = m + tl.log(s)
        y = tl.load(labels + row)
        x_y = tl.load(base + y).to(tl.float32)
        tl.store(lse_out + row, lse)
        tl.store(ce_out + row, lse - x_y)
        tl.store(pred_out + row, best_i.to(tl.int64))

    @triton.jit
    def grad_kernel(logits, labels, lse_in, stride, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ptr = logits + row * stride + idx
        keep = idx < V
        x = tl.load(ptr, mask=keep, other=0.0).to(tl.float32)
        lse = tl.load(lse_in + row)
        y = tl.load(labels + row)
        g = tl.exp(x - lse) - (idx == y).to(tl.float32)
        tl.store(ptr, g.to(logits.dtype.element_ty), mask=keep)

    return stats_kernel, grad_kernel


def ce_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits `[R, V]` (rows contiguous), labels `[R]` in [0, V) -> (ce fp32, argmax int64, lse fp32)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"ce_stats needs rows of contiguous logits, got strides {logits.stride()}")
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    ce = torch.empty_like(lse)
    pred = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        stats, _ = _kernels()
        stats[(rows,)](logits, labels, lse, ce, pred, logits.stride(0), V=vocab, BLOCK=BLOCK_V, num_warps=STATS_WARPS)
    return ce, pred, lse


def softmax_grad_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """In place: logits `[R, V]` become `softmax(logits) - onehot(labels)` in their own dtype."""
    rows, vocab = logits.shape
    if rows:
        _, grad = _kernels()
        grid = (rows, -(-vocab // BLOCK_V))
        grad[grid](logits, labels, lse, logits.stride(0), V=vocab, BLOCK=BLOCK_V, num_warps=GRAD_WARPS)
    return logits
