"""Counted FLOPs for MFU. Model FLOPs only: the work the math needs, not what a kernel wastes.

A matmul [m, k] x [k, n] is 2*m*k*n FLOPs. Training a trainable matmul costs 3x its forward
(forward, input gradient, weight gradient). Exceptions, because the graph does not need them:
- the frozen LM head: forward + input gradient (2x);
- `fc`: its input comes from the target and needs no gradient, so forward + weight gradient (2x).
  The context k/v projections feed on `ctx`, which does need a gradient (it reaches `fc`): 3x.
Attention counts only visible (query, key) pairs: 4 * head_dim * heads per pair forward
(QK^T and PV), 2x that backward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterShape:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    num_target_layers: int

    @classmethod
    def from_args(cls, args) -> "DrafterShape":
        """The shape of a drafter built from `args` (a `DrafterArgs`)."""
        return cls(args.hidden_size, args.intermediate_size, args.num_layers, args.num_heads, args.num_kv_heads,
                   args.head_dim, args.vocab_size, args.num_target_layers)


def drafter_matmul_flops(s: DrafterShape, seq_len: int, num_anchors: int, block_size: int) -> float:
    """Training FLOPs of one drafter step except attention scores (those depend on the mask)."""
    n = num_anchors * block_size  # block tokens (queries)
    t = seq_len  # context tokens (keys/values only)
    h, q, kv = s.hidden, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    fc = 2 * t * s.num_target_layers * h * h * 2
    per_layer = 3 * (
        2 * n * h * q  # q_proj
        + 2 * (n + t) * h * 2 * kv  # k_proj, v_proj on block and context rows
        + 2 * n * q * h  # o_proj
        + 2 * n * 3 * h * s.intermediate  # gate, up, down
    )
    head = 2 * 2 * num_anchors * (block_size - 1) * h * s.vocab
    return float(fc + s.num_layers * per_layer + head)


def drafter_attention_flops(s: DrafterShape, visible_pairs: float) -> float:
    """Training FLOPs of attention over `visible_pairs` (query, key) pairs summed over layers."""
    return float(3 * 4 * s.num_heads * s.head_dim * visible_pairs)


def target_forward_flops(spec, num_layers: int, tokens: int, causal_pairs: float) -> float:
    """Forward FLOPs of the first `num_layers` decoder layers of a target of shape `spec` (a
    `target.TargetSpec`) over `tokens` (no LM head)."""
    hidden, heads, head_dim = spec.hidden_size, spec.num_heads, spec.head_dim
    q, kv = heads * head_dim, spec.num_kv_heads * head_dim
    per_token = 2 * hidden * (q + 2 * kv) + 2 * q * hidden + 2 * 3 * hidden * spec.intermediate_size
    return float(num_layers * (tokens * per_token + 4 * heads * head_dim * causal_pairs))


def causal_pairs_packed(doc_lengths: list[int]) -> float:
    """Visible pairs of a block-diagonal causal mask over documents of the given lengths."""
    return float(sum(n * (n + 1) // 2 for n in doc_lengths))
