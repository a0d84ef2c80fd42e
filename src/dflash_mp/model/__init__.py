"""The DFlash drafter, its training-time attention masks, anchor sampling and loss."""

from dflash_mp.model.anchors import anchor_candidates, block_labels, build_blocks, sample_anchors
from dflash_mp.model.attention import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    BlockAttention,
    build_block_attention,
    make_mask_mod,
    resolve_backend,
)
from dflash_mp.model.drafter import DFlashDrafter, DrafterArgs, default_target_layer_ids
from dflash_mp.model.loss import block_metrics, dflash_loss, fused_linear_cross_entropy, slot_weights

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "BlockAttention",
    "DFlashDrafter",
    "DrafterArgs",
    "anchor_candidates",
    "block_labels",
    "block_metrics",
    "build_block_attention",
    "build_blocks",
    "default_target_layer_ids",
    "dflash_loss",
    "fused_linear_cross_entropy",
    "make_mask_mod",
    "resolve_backend",
    "sample_anchors",
    "slot_weights",
]
