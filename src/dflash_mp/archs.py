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
    # The text decoder of Qwen3.5-27B (a hybrid of linear-attention and full-attention layers; the
    # full-attention layers' shapes are what the drafter copies). tokenizer_len is approximate: any
    # value below vocab_size leaves the default mask row valid.
    "Qwen/Qwen3.5-27B": dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7,
        max_position_embeddings=262144, tie_word_embeddings=False, tokenizer_len=248077),
}


def known_target_config(path: str) -> dict | None:
    """The table entry for a hub id (config.json fields only), or None."""
    arch = TARGET_ARCHS.get(path)
    return None if arch is None else {k: v for k, v in arch.items() if k != "tokenizer_len"}
