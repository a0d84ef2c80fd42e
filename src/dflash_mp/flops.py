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


def causal_pairs_packed(doc_lengths: list[int]) -> float:
    """Visible pairs of a block-diagonal causal mask over documents of the given lengths."""
    return float(sum(n * (n + 1) // 2 for n in doc_lengths))


def num_experts(config: dict) -> int:
    """The routed experts of a decoder config dict (0: no MoE layers)."""
    return config.get("num_experts") or config.get("num_local_experts") or 0


def is_sparse_layer(config: dict, i: int) -> bool:
    """Layer `i` of a mixture-of-experts config routes its MLP (Qwen3-MoE's `mlp_only_layers` and
    `decoder_sparse_step` rules; every layer of a model without them)."""
    if not num_experts(config) or i in (config.get("mlp_only_layers") or []):
        return False
    return (i + 1) % (config.get("decoder_sparse_step") or 1) == 0


# Model types whose full-attention layers project an output gate beside the queries (Qwen3.5's gated
# attention: q_proj gives 2 x heads x head_dim features, the second half gating the attention's output).
GATED_ATTENTION = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def layer_forward_flops(config: dict, i: int, tokens: int, causal_pairs: float) -> float:
    """Forward FLOPs of decoder layer `i` of a target (a flat config.json dict) over `tokens` tokens
    whose attention sees `causal_pairs` (query, key) pairs: what stage balancing weighs.

    Full and sliding attention layers: q/k/v/o projections (a gated attention's q_proj twice as wide:
    GATED_ATTENTION) plus attention scores (a sliding window caps the pairs); linear-attention layers
    (Qwen3.5 Gated DeltaNet): their projections and a recurrence linear in `tokens`. MLPs: dense, or
    the routed experts a token visits (`top_k`) plus the router and, where there is one, the shared
    expert with its one-output gate (Qwen's `shared_expert_gate`).
    """
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = (config.get("num_key_value_heads") or heads) * head_dim
    q = heads * head_dim
    kind = (config.get("layer_types") or ["full_attention"] * (i + 1))[i]
    if kind == "linear_attention":
        kh, kd = config["linear_num_key_heads"], config["linear_key_head_dim"]
        vh, vd = config["linear_num_value_heads"], config["linear_value_head_dim"]
        per_token = 2 * h * (2 * kh * kd + 2 * vh * vd + 2 * vh) + 2 * vh * vd * h + 4 * vh * kd * vd
        pairs = 0.0
    else:
        gate = q if config.get("model_type") in GATED_ATTENTION else 0
        per_token = 2 * h * (q + gate + 2 * kv) + 2 * q * h
        pairs = causal_pairs
        window = config.get("sliding_window")
        if kind == "sliding_attention" and window:
            pairs = min(causal_pairs, float(tokens * window))
    if is_sparse_layer(config, i):
        per_token += 2 * 3 * h * config["moe_intermediate_size"] * config["num_experts_per_tok"]
        shared = config.get("shared_expert_intermediate_size") or 0
        per_token += 2 * 3 * h * shared + (2 * h if shared else 0) + 2 * h * num_experts(config)
    else:
        per_token += 2 * 3 * h * config["intermediate_size"]
    return float(tokens * per_token + 4 * heads * head_dim * pairs)


def target_layers_flops(config: dict, layers: range, tokens: int, causal_pairs: float) -> float:
    """Forward FLOPs of the target's decoder layers `layers` (each by its own kind: `layer_forward_flops`)."""
    return sum(layer_forward_flops(config, i, tokens, causal_pairs) for i in layers)
