"""Weighted block cross-entropy against the target's frozen LM head, and block metrics.

The logits of `A*(B-1)` rows over a ~150k vocabulary would be several GiB, so the LM head and
the cross-entropy are fused per row chunk: each chunk's logits live only long enough to produce
the loss, the argmax and the gradient w.r.t. the chunk's hidden rows. Backward then only scales
that saved gradient, with no second pass over the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ce_kernels import ce_stats, softmax_grad_

# gamma of the slot weights exp(-(k-1)/gamma) for the block sizes the recipe knows.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def slot_weights(
    block_size: int,
    gamma: float | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """`[B]` fp32: 0 for slot 0 (the given anchor token), `exp(-(k-1)/gamma)` for slot k >= 1."""
    if gamma is None:
        if block_size not in DEFAULT_GAMMA:
            raise ValueError(
                f"no default gamma for block_size={block_size} (known: {sorted(DEFAULT_GAMMA)}); "
                "pass gamma explicitly"
            )
        gamma = DEFAULT_GAMMA[block_size]
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), 0.0)


def _ce_chunk(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, need_grad: bool):
    """One row chunk: per-row CE, argmax and (if `need_grad`) d ce / d h through the frozen head."""
    # The GEMM accumulates in fp32; softmax statistics are at least fp32 (fp64 stays fp64, which
    # lets tests compare against a plain reference exactly).
    logits = F.linear(h, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # (Written as amax + sum(exp(x - max)), Inductor's online-softmax pass, the GPU chunk was slower
    # on the H200: logsumexp stays.)
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(1, y[:, None])[:, 0]
    pred = logits.argmax(dim=-1)
    if not need_grad:
        return ce, pred, None
    # d ce / d logits = softmax - onehot(label), then back through the frozen head.
    probs = torch.exp(logits - lse[:, None])
    if torch.compiler.is_compiling():
        # Pointwise, so Inductor writes the gradient once, in the head's dtype, from the pass that
        # reads the logits; a scatter would first materialise fp32 probabilities (on the 8B step one
        # extra 2.5 GB write and a cast pass per chunk).
        onehot = torch.arange(logits.shape[1], device=y.device)[None, :] == y[:, None]
        probs = probs - onehot.to(probs.dtype)
    else:  # eagerly, a scatter touches one element per row instead of a pass over the vocabulary
        probs = probs.scatter_add(1, y[:, None], probs.new_full((y.shape[0], 1), -1.0))
    return ce, pred, (probs.to(weight.dtype) @ weight).to(h.dtype)


def _ce_chunk_triton(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, need_grad: bool):
    """`_ce_chunk` with the passes over the logits in Triton (model/ce_kernels.py): one read for
    the statistics, one read and one in-place write for the gradient."""
    logits = F.linear(h, weight)
    ce, pred, lse = ce_stats(logits, y)
    if not need_grad:
        return ce, pred, None
    return ce, pred, (softmax_grad_(logits, y, lse) @ weight).to(h.dtype)


LOSS_KERNELS = ("eager", "inductor", "triton")
_COMPILED_CHUNK = None


def _chunk_fn(kernel: str):
    """The chunk for loss kernel `kernel` (LOSS_KERNELS). `inductor`: the chunk compiled once per
    process; Inductor fuses the logsumexp, gather, argmax and softmax-gradient passes over the
    `[chunk, vocab]` logits into a few kernels, so fp32 logits are never written out. Inside an
    outer compiled step the plain chunk is traced."""
    global _COMPILED_CHUNK
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"loss kernel {kernel!r}: use one of {LOSS_KERNELS}")
    if kernel == "eager" or torch.compiler.is_compiling():
        return _ce_chunk
    if kernel == "triton":
        return _ce_chunk_triton
    if _COMPILED_CHUNK is None:
        _COMPILED_CHUNK = torch.compile(_ce_chunk, dynamic=False)
    return _COMPILED_CHUNK


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Per-row CE of `hidden @ weight.T` against `labels`, chunked over rows."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, need_grad: bool, kernel: str):
        ce_parts, pred_parts, grad_parts = [], [], []
        fn = _chunk_fn(kernel)
        for start in range(0, hidden.shape[0], chunk_size):
            ce, pred, grad = fn(hidden[start : start + chunk_size], weight, labels[start : start + chunk_size],
                                need_grad)
            ce_parts.append(ce)
            pred_parts.append(pred)
            if need_grad:
                grad_parts.append(grad)
        ce = torch.cat(ce_parts)
        pred = torch.cat(pred_parts)
        ctx.mark_non_differentiable(pred)
        if need_grad:
            ctx.save_for_backward(torch.cat(grad_parts))
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce, grad_pred):
        (grad_hidden,) = ctx.saved_tensors
        # Row r's ce depends on hidden row r alone, so d(sum_r g_r * ce_r)/d h_r = g_r * d ce_r/d h_r:
        # scaling the saved per-row gradient is exact, not an approximation.
        return grad_hidden * grad_ce[:, None].to(grad_hidden.dtype), None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    kernel: str = "eager",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row CE `[N]` (fp32, or fp64 for fp64 inputs) and argmax `[N]` of `hidden [N, H] @ weight[V, H].T`.

    `weight` is treated as frozen: it never receives a gradient. The number of chunks is
    `ceil(N / chunk_size)`, fixed for fixed shapes, so a compiled step traces a fixed loop.
    `kernel`: how each chunk's passes over the logits run (LOSS_KERNELS; the eager step's largest
    fusable cost): eager PyTorch, a torch.compile'd chunk, or Triton kernels (CUDA).
    """
    need_grad = hidden.requires_grad and torch.is_grad_enabled()
    return _FusedLinearCrossEntropy.apply(hidden, weight.detach(), labels, chunk_size, need_grad, kernel)


def dflash_loss(
    block_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 1024,
    kernel: str = "eager",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE over slots 1..B-1 of every block (`kernel`: see fused_linear_cross_entropy).

    block_hidden `[A*B, H]` (the drafter output) or `[A*(B-1), H]` (slots 1..B-1 only, the drafter's
    `predicted_only` output), labels/label_mask `[A, B]`, weights `[B]`.
    Returns `(loss, correct)`: `loss = sum(w * ce * mask) / sum(w * mask)` (0 when nothing is
    supervised) and `correct [A, B]` bool, argmax == label, slot 0 always False.
    """
    A, B = labels.shape
    if block_hidden.shape[0] == A * B:
        hidden = block_hidden.view(A, B, -1)[:, 1:].reshape(A * (B - 1), -1)
    elif block_hidden.shape[0] == A * (B - 1):
        hidden = block_hidden
    else:
        raise ValueError(f"block_hidden has {block_hidden.shape[0]} rows for {A} blocks of {B}: "
                         f"give A*B = {A * B} (every slot) or A*(B-1) = {A * (B - 1)} (slots 1..B-1)")
    ce, pred = fused_linear_cross_entropy(hidden, lm_head_weight, labels[:, 1:].reshape(-1), chunk_size, kernel)
    w = weights[1:].to(ce.dtype)[None, :] * label_mask[:, 1:].to(ce.dtype)
    loss = (ce.view(A, B - 1) * w).sum() / w.sum().clamp(min=1e-6)
    hits = pred.view(A, B - 1) == labels[:, 1:]
    correct = torch.cat([hits.new_zeros(A, 1), hits], dim=1)
    return loss, correct


def block_metrics(correct: torch.Tensor, label_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-slot accuracy `acc_slot_{k}` (k = 1..B-1) and `tau_sim`, as 0-d tensors (no host sync).

    `tau_sim` is the mean over blocks with any supervised slot of 1 + the number of leading slots,
    from slot 1, that are supervised and correct: the acceptance length a greedy verifier would
    grant this block if the rest of the document were the target's own output.
    """
    hit = (correct & label_mask)[:, 1:]
    supervised = label_mask[:, 1:]
    acc = hit.sum(0).float() / supervised.sum(0).clamp(min=1).float()
    block_valid = label_mask.any(dim=1)
    leading = hit.long().cumprod(dim=1).sum(dim=1)
    tau = ((1 + leading) * block_valid).sum().float() / block_valid.sum().clamp(min=1).float()
    metrics = {f"acc_slot_{k}": acc[k - 1] for k in range(1, correct.shape[1])}
    metrics["tau_sim"] = tau
    return metrics
