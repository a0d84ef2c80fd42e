"""Attention of the target's packed rows: which implementation runs, and the packed-document masks it
is fed (one per layer type). Every choice keeps documents apart exactly; they differ only in speed."""

from __future__ import annotations

import logging

import torch

from ..block_mask import build_block_mask

log = logging.getLogger(__name__)

ATTN_CHOICES = ("sdpa", "flex_attention", "eager")

# The name under which `_flex_outside_graph` is registered with transformers' attention functions. No
# "flash" in it: transformers takes any implementation whose name contains "flash" for flash attention
# (`is_flash_attention_requested`) and changes what it passes and masks accordingly.
FLEX_OUTSIDE_GRAPH = "packed_flex_outside_graph"


def supports_flex(model_cls: type) -> bool:
    """Whether transformers runs this model class through its own flex_attention integration
    (transformers 5.17-5.24 do not for Qwen3.5: `_supports_flex_attn` is unset there)."""
    return bool(getattr(model_cls, "_supports_flex_attn", False))


def choose_attention(name: str, device: torch.device, model_cls: type) -> str:
    """`target.attn_implementation` for one model class: `auto` is flex_attention on CUDA where
    transformers supports it for the class, else sdpa with the exact dense document mask (the
    attention of the targets without flex support is a few % of their FLOPs: Qwen3.5 runs full
    attention in 1 layer of 4); sdpa on CPU. `flex_attention` asked for explicitly also runs on a
    class without transformers' support, through the project's registered function."""
    if name == "auto":
        if torch.device(device).type != "cuda":
            return "sdpa"
        return "flex_attention" if supports_flex(model_cls) else "sdpa"
    if name not in ATTN_CHOICES:
        raise ValueError(f"target.attn_implementation={name!r}: use auto or one of {', '.join(ATTN_CHOICES)}.")
    return name


def load_attention(attn: str, model_cls: type) -> str:
    """The implementation to load the model with: a class that transformers will not load with
    flex_attention is loaded with sdpa, and TargetWorker switches it to the registered flex function."""
    return "sdpa" if attn == "flex_attention" and not supports_flex(model_cls) else attn


def describe_attention(attn: str, model_cls: type, compiled: bool) -> str:
    """One line for the log and the resolved-choices table."""
    if attn != "flex_attention":
        why = "" if attn != "sdpa" else " with the dense packed-document mask"
        return f"{attn}{why}"
    where = "transformers' integration" if supports_flex(model_cls) else f"registered as {FLEX_OUTSIDE_GRAPH}"
    return f"flex_attention ({where}{', its own kernel outside the compiled graph' if compiled else ''})"


def doc_causal_block_mask(doc_ids: torch.Tensor, window: int | None = None):
    """flex_attention BlockMask of the packed-document causal mask: no dense [T, T] tensor, and
    blocks outside every document's triangle are skipped by the kernel. `window`: sliding-window
    layers also require q - kv < window (transformers' sliding-window mask)."""
    def mask_mod(b, h, q, kv):
        seen = (doc_ids[q] == doc_ids[kv]) & (kv <= q)
        return seen if window is None else seen & (q - kv < window)

    t = doc_ids.shape[0]
    return build_block_mask(mask_mod, t, t, doc_ids.device)


def block_diagonal_causal_mask(doc_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[1, 1, T, T] bool: token i sees token j iff same document and j <= i (padding sees itself);
    with `window`, also i - j < window."""
    t = doc_ids.shape[0]
    same = doc_ids[:, None] == doc_ids[None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    if window is not None:
        causal = causal.triu(-(window - 1))
    eye = torch.eye(t, dtype=torch.bool, device=doc_ids.device)
    return ((same & causal) | eye)[None, None]


def sliding_window_of(config) -> int | None:
    """The window of the target's sliding-window layers, None if it has none."""
    if "sliding_attention" not in (getattr(config, "layer_types", None) or []):
        return None
    window = getattr(config, "sliding_window", None)
    if not window:
        raise ValueError(f"the target has sliding_attention layers but sliding_window={window!r} in its "
                         "config.json: set sliding_window there (or check target.path).")
    return int(window)


def _flex_outside_graph(module, query, key, value, attention_mask, **kwargs):
    """transformers' flex_attention forward, run outside the compiled target graph.

    Traced into the graph, Inductor fuses each layer's q/k RMSNorm and RoPE into the flex_attention
    kernel as a prologue that every (query tile, key tile) pair recomputes: 15.2 ms per Qwen3-8B
    batch (T = 3072) against 6.4 ms for the same attention compiled on its own (BENCHMARKS.md).
    Dynamo breaks the graph here; the norm/RoPE before and the projections after stay compiled.
    """
    from transformers.integrations.flex_attention import flex_attention_forward

    return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_flex_outside_graph() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX_OUTSIDE_GRAPH, torch.compiler.disable(_flex_outside_graph))
    return FLEX_OUTSIDE_GRAPH
