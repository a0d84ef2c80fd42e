"""The frozen target: what it is (spec), its weights (weights), the attention and linear-attention
paths of packed rows (attention, linear_attn), the worker that captures its layers (worker), and the
packing self-check every target rank passes at load (packing)."""

from .attention import (FLEX_OUTSIDE_GRAPH, VARLEN_OUTSIDE_GRAPH, block_diagonal_causal_mask, choose_attention,
                        doc_causal_block_mask)
from .spec import (TargetConfig, TargetSpec, capture_layer_ids, check_model_path, default_layer_ids, load_target_config,
                   mask_token_id, resolve_dtype, rope_from_config, text_config_dict)
from .weights import (RANDOM_INIT, Elsewhere, load_causal_lm, load_stage, load_target_head, random_init_seed, random_target,
                      random_target_head, strip_to_stage, truncate)
from .worker import TargetWorker

__all__ = [
    "FLEX_OUTSIDE_GRAPH", "RANDOM_INIT", "VARLEN_OUTSIDE_GRAPH", "Elsewhere", "TargetConfig", "TargetSpec",
    "TargetWorker",
    "block_diagonal_causal_mask", "capture_layer_ids", "check_model_path", "choose_attention", "default_layer_ids",
    "doc_causal_block_mask", "load_causal_lm", "load_stage", "load_target_config", "load_target_head", "mask_token_id",
    "random_init_seed", "random_target", "random_target_head", "resolve_dtype", "rope_from_config",
    "strip_to_stage", "text_config_dict", "truncate",
]
