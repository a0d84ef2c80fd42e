"""Triton kernels for the fused CE over the frozen LM head: one pass over each row of logits for
the softmax statistics, one for the gradient (the kernels themselves are in ce_kernels_triton.py).

Per chunk of R rows the logits `[R, V]` come from cuBLAS in the head's dtype. `ce_stats` reads
them once and returns the log-sum-exp, the CE against the labels and the argmax. `softmax_grad_`
then overwrites the logits with `softmax - onehot(label)`, the gradient w.r.t. the logits, in
place: one read and one write, and no second `[R, V]` buffer. Inductor's fused chunk (the
`inductor` loss kernel) reads the logits three times and writes the gradient once.

The statistics pass keeps one program per row. Reducing every tile across the program's threads
(max, argmax and sum: shuffles and a barrier each) bound it, not the bytes: that way (`STATS =
"tiles"`) it read the logits at well under the gradient pass's rate (BENCHMARKS.md). By default
(`STATS = "lanes"`) each of the `STATS_BLOCK` lanes of a tile instead keeps its own running
maximum, sum of exponentials and first index of its maximum over the row, with elementwise
updates only and one exp per logit, and the lanes are combined once, after the row. With
`"lanes-tilemax"` the lanes share one running maximum instead, reduced once per tile.

The arithmetic is the PyTorch chunk's: logits promoted to fp32, `lse = max + log(sum(exp(x -
max)))` (summed in another order), first index of the maximum for the argmax. Triton is imported
on first use, so the module loads where only the CPU build of torch is installed.
"""

from __future__ import annotations

import torch

from .. import triton_launch

# Read at every call, so a benchmark can switch kernels and tiles between calls.
STATS_KERNELS = ("lanes", "lanes-tilemax", "tiles")
STATS = "lanes"  # the statistics kernel, one of STATS_KERNELS
# Lanes of the statistics pass: 1024 over 4 warps is one 16-byte load and 8 lanes of state per
# thread, 40 registers on sm_90, so 12 rows' programs share an SM and keep its loads in flight
# (2048 lanes take 72). "tiles" measured best at 4096 over 4 warps (bench/ce_chunk.py).
STATS_BLOCK = 1024
STATS_WARPS = 4
STATS_STAGES = 1  # "lanes": tiles in flight per program through shared memory (1: loads to registers)
BLOCK_V = 4096  # logits per tile of the gradient pass: 8 KiB of bf16 per row
GRAD_WARPS = 8  # warps per tile of the gradient pass
GRAD_TILES = 1  # tiles per program of the gradient pass (1: one program per row and tile)
# Tried and removed (afa2461, call K3 of BENCHMARKS.md): both passes in one persistent kernel, a row per
# SM at a time, so that the gradient pass reads the row back from L2. It was slower than these two
# kernels: one row in flight per SM does not keep the memory busy.


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device` (CUDA with Triton, or Triton's CPU interpreter)."""
    return triton_launch.available(device)


def ce_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits `[R, V]` (rows contiguous), labels `[R]` in [0, V) -> (ce fp32, argmax int64, lse fp32)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"ce_stats needs rows of contiguous logits, got strides {logits.stride()}")
    if STATS not in STATS_KERNELS:
        raise ValueError(f"ce_kernels.STATS={STATS!r}: use one of {STATS_KERNELS}")
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    ce = torch.empty_like(lse)
    pred = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        from .ce_kernels_triton import stats_lanes_kernel, stats_tiles_kernel

        args = (logits, labels, lse, ce, pred, logits.stride(0))
        if STATS == "tiles":
            stats_tiles_kernel[(rows,)](*args, V=vocab, BLOCK=STATS_BLOCK, num_warps=STATS_WARPS)
        else:
            stats_lanes_kernel[(rows,)](*args, V=vocab, BLOCK=STATS_BLOCK, TILE_MAX=STATS == "lanes-tilemax",
                                        STAGES=STATS_STAGES, num_warps=STATS_WARPS)
    return ce, pred, lse


def softmax_grad_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """In place: logits `[R, V]` become `softmax(logits) - onehot(labels)` in their own dtype."""
    rows, vocab = logits.shape
    if rows:
        from .ce_kernels_triton import grad_kernel

        grid = (rows, -(-vocab // (BLOCK_V * GRAD_TILES)))
        grad_kernel[grid](logits, labels, lse, logits.stride(0), V=vocab, BLOCK=BLOCK_V, TILES=GRAD_TILES,
                          num_warps=GRAD_WARPS)
    return logits
