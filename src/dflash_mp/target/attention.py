"""Attention of the target's packed rows: which implementation runs, and the packed-document masks it
is fed (one per layer type; `triton` takes each row's visible key ranges, `varlen` the row's document
bounds instead). Every choice keeps documents apart exactly; they differ only in speed."""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from ..block_mask import build_block_mask
from ..triton_launch import available as triton_available
from .doc_attn import ATTN_NAME

log = logging.getLogger(__name__)

ATTN_CHOICES = ("triton", "sdpa", "flex_attention", "varlen", "eager")

# The name under which `_flex_outside_graph` is registered with transformers' attention functions. No
# "flash" in it: transformers takes any implementation whose name contains "flash" for flash attention
# (`is_flash_attention_requested`) and changes what it passes and masks accordingly.
FLEX_OUTSIDE_GRAPH = "packed_flex_outside_graph"
# The same for `_varlen_outside_graph` (no "flash" either, for the same reason).
VARLEN_OUTSIDE_GRAPH = "packed_varlen_outside_graph"


def supports_flex(model_cls: type) -> bool:
    """Whether transformers runs this model class through its own flex_attention integration
    (transformers 5.17-5.24 do not for Qwen3.5: `_supports_flex_attn` is unset there)."""
    return bool(getattr(model_cls, "_supports_flex_attn", False))


def choose_attention(name: str, device: torch.device, model_cls: type) -> str:
    """`target.attn_implementation` for one model class: `auto` is the Triton packed-document kernel
    (doc_attn.py) on CUDA with Triton; TargetWorker.load falls back to `fallback_attention` where the
    target's shapes do not suit it. sdpa on CPU. `flex_attention` asked for explicitly also runs on a
    class without transformers' support, through the project's registered function; so do `varlen`
    (FlashAttention-2's varlen kernel, CUDA only) and `triton`, on any class."""
    if name == "auto":
        if torch.device(device).type != "cuda":
            return "sdpa"
        return "triton" if triton_available(torch.device(device)) else fallback_attention(model_cls)
    if name not in ATTN_CHOICES:
        raise ValueError(f"target.attn_implementation={name!r}: use auto or one of {', '.join(ATTN_CHOICES)}.")
    if name == "varlen":
        check_varlen(device)
    if name == "triton" and not triton_available(torch.device(device)):
        raise ValueError(f"target.attn_implementation=triton needs Triton on CUDA (this target runs on "
                         f"{torch.device(device).type}): use target.attn_implementation=auto or sdpa.")
    return name


def fallback_attention(model_cls: type) -> str:
    """`auto` where the Triton kernel cannot run: flex_attention where transformers supports it for the
    class, else sdpa with the exact dense document mask (the attention of the targets without flex
    support is a few % of their FLOPs: Qwen3.5 runs full attention in 1 layer of 4)."""
    return "flex_attention" if supports_flex(model_cls) else "sdpa"


def load_attention(attn: str, model_cls: type) -> str:
    """The implementation to load the model with: a class that transformers will not load with
    flex_attention is loaded with sdpa, and TargetWorker switches it to the registered flex function;
    `varlen` and `triton` are always loaded with sdpa and switched to their registered functions."""
    if attn in ("varlen", "triton"):
        return "sdpa"
    return "sdpa" if attn == "flex_attention" and not supports_flex(model_cls) else attn


def describe_attention(attn: str, model_cls: type, compiled: bool) -> str:
    """One line for the log and the resolved-choices table."""
    if attn == "triton":
        return (f"triton (the packed-document kernel, registered as {ATTN_NAME}"
                f"{', inside the compiled layers' if compiled else ''})")
    if attn == "varlen":
        return (f"varlen (FlashAttention-2 over the row's documents, registered as {VARLEN_OUTSIDE_GRAPH}"
                f"{', outside the compiled graph' if compiled else ''})")
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
    kernel as a prologue that every (query tile, key tile) pair recomputes, more than twice the time
    of the same attention compiled on its own (BENCHMARKS.md, issue 4.3).
    Dynamo breaks the graph here; the norm/RoPE before and the projections after stay compiled.
    """
    from transformers.integrations.flex_attention import flex_attention_forward

    return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_flex_outside_graph() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX_OUTSIDE_GRAPH, torch.compiler.disable(_flex_outside_graph))
    return FLEX_OUTSIDE_GRAPH


# ------------------------------------------------------------------------------------------ varlen
class VarlenKernel:
    """`torch.nn.attention.varlen.varlen_attn` called alike across torch versions, read from its
    signature: causal as `is_causal=True` (torch 2.10) and/or `window_size=(-1, 0)` (2.11 on), a
    sliding window w as `window_size=(w - 1, 0)` (where there is none, a ValueError), and
    `enable_gqa=True` where it exists and the key/value heads are fewer (FlashAttention-2 takes them
    as they are)."""

    def __init__(self, fn):
        params = inspect.signature(fn).parameters
        self.fn = fn
        self.causal_flag = "is_causal" in params
        self.windows = "window_size" in params
        self.gqa_flag = "enable_gqa" in params
        if not (self.causal_flag or self.windows):
            raise ValueError(f"torch {torch.__version__}: varlen_attn{inspect.signature(fn)} takes neither is_causal "
                             "nor window_size, so it cannot run causal: use target.attn_implementation=flex_attention.")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                 scale: float | None, window: int | None = None) -> torch.Tensor:
        """Causal attention of q [T, Hq, D], k, v [T, Hkv, D] within each span of `cu_seqlens`
        (int32 [N + 1]); `window`: also q - kv < window. Returns [T, Hq, D]."""
        kwargs: dict = {"scale": scale}
        if self.causal_flag:
            kwargs["is_causal"] = True
        if self.windows:
            kwargs["window_size"] = (window - 1 if window else -1, 0)
        elif window:
            raise ValueError(f"torch {torch.__version__}'s varlen_attn has no window_size: it cannot run "
                             "sliding-window layers; use target.attn_implementation=flex_attention.")
        if self.gqa_flag and q.shape[1] != k.shape[1]:
            kwargs["enable_gqa"] = True
        return self.fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


@functools.cache
def varlen_kernel() -> VarlenKernel | None:
    """torch's varlen kernel, adapted; None before torch 2.10 (no torch.nn.attention.varlen)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return VarlenKernel(varlen_attn)


def check_varlen(device: torch.device, dtype: torch.dtype | None = None, window: int | None = None) -> None:
    """A ValueError naming the fix unless `varlen` can run here: on CUDA, torch >= 2.10, fp16/bf16,
    and a kernel with sliding windows where the target has sliding-window layers (`window`)."""
    what = "target.attn_implementation='varlen' (FlashAttention-2's varlen kernel)"
    if torch.device(device).type != "cuda":
        raise ValueError(f"{what} runs on CUDA only, and this target runs on {torch.device(device).type}: "
                         "use target.attn_implementation=sdpa or auto.")
    kernel = varlen_kernel()
    if kernel is None:
        raise ValueError(f"{what} needs torch >= 2.10 (torch.nn.attention.varlen), not {torch.__version__}: "
                         "upgrade torch, or use target.attn_implementation=flex_attention or auto.")
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{what} runs in bfloat16 or float16, not {dtype}: set target.dtype=bfloat16 (or auto), "
                         "or use target.attn_implementation=flex_attention.")
    if window is not None and not kernel.windows:
        raise ValueError(f"{what}: torch {torch.__version__}'s varlen_attn has no window_size, and the target has "
                         f"sliding-window layers (window {window}): use target.attn_implementation=flex_attention.")


def _varlen_outside_graph(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          sliding_window=None, **kwargs):
    """FlashAttention-2's varlen kernel over the documents of the row being run (the worker's
    `documents(...)`; `attention_mask` is not read), called as transformers calls an attention
    function: query [1, Hq, T, D], key/value [1, Hkv, T, D]; returns ([1, T, Hq, D], None), as
    sdpa_attention_forward does. Outside the compiled graph: the row's document count varies."""
    from .linear_attn import active_spans

    spans = active_spans()
    if spans is None:
        raise RuntimeError(f"{VARLEN_OUTSIDE_GRAPH} ran outside TargetWorker's forward: it reads the packed row's "
                           "documents from there (linear_attn.documents).")
    if query.shape[0] != 1 or int(spans.cpu[-1]) != query.shape[2]:
        raise ValueError(f"{VARLEN_OUTSIDE_GRAPH} takes one packed row: query {tuple(query.shape)}, row of "
                         f"{int(spans.cpu[-1])} tokens.")
    if dropout or kwargs.get("softcap") is not None:
        raise ValueError(f"{VARLEN_OUTSIDE_GRAPH} runs without dropout and softcap.")
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D], the last dim contiguous
    out = varlen_kernel()(q, k, v, spans.int32, spans.longest, scale, window)
    return out[None], None


def register_varlen_outside_graph() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_OUTSIDE_GRAPH, torch.compiler.disable(_varlen_outside_graph))
    return VARLEN_OUTSIDE_GRAPH
