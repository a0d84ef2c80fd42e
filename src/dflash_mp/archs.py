"""Shapes of public targets, known without downloading anything: presets validate, the planner runs
and `builtin:random-*` targets copy real shapes from this table alone."""

from __future__ import annotations

# config.json fields (text decoder only). `tokenizer_len` is len(tokenizer): the first row past it is the
# default mask token when the embedding has spare rows.
TARGET_ARCHS: dict[str, dict] = {
    "Qwen/Qwen3-4B": dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=True, tokenizer_len=151669),
    "Qwen/Qwen3-8B": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=False, tokenizer_len=151669),
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=False, tokenizer_len=128256),
    # Llama 3.1's shapes at 70B: 140 GB of bf16 weights, more than one GPU holds (target.stages=2).
    "meta-llama/Llama-3.3-70B-Instruct": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=False, tokenizer_len=128256),
    # Qwen3-MoE: every layer routes its MLP to 8 of 128 experts (`num_experts`, read by flops.py);
    # intermediate_size is the dense MLP width the config also carries (no layer of this model uses
    # it). 470 GB of bf16 weights (target.stages=4).
    "Qwen/Qwen3-235B-A22B": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        tie_word_embeddings=False, tokenizer_len=151669),
    # Qwen/Qwen3.5-27B: its whole architecture, from HF_ARCHS below.
}


def known_target_config(path: str) -> dict | None:
    """The table entry for a hub id (config.json fields only), or None."""
    arch = TARGET_ARCHS.get(path)
    return None if arch is None else {k: v for k, v in arch.items() if k != "tokenizer_len"}


# ------------------------------------------------------------------ hybrid and MoE architectures
# Decoder configs of targets beyond dense Qwen3/Llama: Qwen3.5 hybrids (Gated DeltaNet linear
# attention, 3 of every 4 layers, plus gated full attention), the Qwen3.5 MoE hybrid and Qwen3-MoE.
#
# Real sizes are written out from the public config.json files (text decoder only), so a random-weight
# target of the real architecture (`builtin:random-qwen3.5-27b` ...) builds without a download; TINY_*
# are CPU-test stand-ins of the same architecture. `hf_config` turns either into a transformers config.

def hybrid_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Qwen3.5's layout: every `interval`-th layer is full attention, the rest linear attention."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


_QWEN3_5_ROPE = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                     mrope_section=[11, 11, 10], mrope_interleaved=True)

HF_ARCHS: dict[str, dict] = {
    "Qwen/Qwen3.5-27B": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=64, layer_types=hybrid_layer_types(64), num_attention_heads=24, num_key_value_heads=4,
        head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=48, rms_norm_eps=1e-6, rope_parameters=_QWEN3_5_ROPE,
        max_position_embeddings=262144, tie_word_embeddings=False),
    "Qwen/Qwen3.5-35B-A3B": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        layer_types=hybrid_layer_types(40), num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, rms_norm_eps=1e-6, rope_parameters=_QWEN3_5_ROPE,
        max_position_embeddings=262144, tie_word_embeddings=False, output_router_logits=False),
    "Qwen/Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_local_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1e6), max_position_embeddings=40960,
        tie_word_embeddings=False, output_router_logits=False),
}

# The text decoder of Qwen3.5-27B in the table of hub targets, written out once: a run reads this
# hybrid from its config.json, and the planner reads it from here. tokenizer_len is approximate: any
# value below vocab_size leaves the default mask row valid.
TARGET_ARCHS["Qwen/Qwen3.5-27B"] = dict(HF_ARCHS["Qwen/Qwen3.5-27B"], tokenizer_len=248077)

# Same architectures, CPU-test sizes (4 layers: linear, linear, linear, full for the hybrids).
_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=4096)
_TINY_LINEAR = dict(num_hidden_layers=4, layer_types=hybrid_layer_types(4), linear_conv_kernel_dim=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, rope_parameters=dict(_QWEN3_5_ROPE, mrope_section=[2, 1, 1]))
TINY_ARCHS: dict[str, dict] = {
    "tiny-qwen3.5": dict(model_type="qwen3_5_text", intermediate_size=128, **_TINY, **_TINY_LINEAR),
    "tiny-qwen3.5-moe": dict(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32, **_TINY, **_TINY_LINEAR),
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", intermediate_size=128, num_hidden_layers=4, num_local_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, **_TINY),
}


def hf_config(fields: dict, **overrides):
    """The transformers config of `fields` (a HF_ARCHS / TINY_ARCHS entry) with `overrides`."""
    from transformers import AutoConfig

    fields = {**fields, **overrides}
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)
