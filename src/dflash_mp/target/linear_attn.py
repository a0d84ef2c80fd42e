"""Linear-attention (Gated DeltaNet) layers of hybrid targets (Qwen3.5) over a packed row.

A packed row holds several documents; a linear-attention layer carries a recurrent state and a causal
convolution window along the row, so both must start fresh at every document, as in serving. The
whole row goes through one varlen call per layer with the document boundaries as `cu_seqlens`:
fla-core's chunked gated delta rule and causal conv1d on CUDA (`pip install -e ".[hybrid]"`), or the
same math in plain PyTorch, one document at a time, where fla-core is missing (CPU, or a GPU host
without it: correct, slower, logged). Both run inside custom ops, so a compiled target keeps one graph.

The boundaries are data of the row: the worker computes them once per row (`Spans`, on the host,
where the doc ids are) and activates them around its forward (`documents`); the ops read them there.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class Spans:
    """The documents of one packed row as `cu_seqlens` [N + 1] (FlashAttention's convention), on the
    host and on the device. Padding (doc id -1) is a span of its own: it is never read."""

    def __init__(self, bounds: torch.Tensor, device: torch.device, non_blocking: bool = False):
        self.cpu = bounds
        pinned = non_blocking and torch.device(device).type == "cuda"
        self.device = (bounds.pin_memory() if pinned else bounds).to(device, non_blocking=pinned)

    @classmethod
    def of(cls, doc_ids: torch.Tensor, device: torch.device) -> "Spans":
        """Built on the host and copied from pinned memory without blocking: from host doc ids, no GPU
        sync (doc ids on the device are read back first, a sync)."""
        docs = doc_ids.cpu()
        cuts = (torch.nonzero(docs[1:] != docs[:-1]).flatten() + 1).tolist()
        return cls(torch.tensor([0, *cuts, docs.shape[0]], dtype=torch.long), device, non_blocking=True)

    def pairs(self) -> list[tuple[int, int]]:
        b = self.cpu.tolist()
        return list(zip(b[:-1], b[1:]))

    @functools.cached_property
    def int32(self) -> torch.Tensor:
        """The device bounds as int32, as FlashAttention's varlen kernel takes them."""
        return self.device.to(torch.int32)

    @functools.cached_property
    def longest(self) -> int:
        """The longest span, in tokens (FlashAttention's max_seqlen), read on the host."""
        return int((self.cpu[1:] - self.cpu[:-1]).max())


_active: list[Spans] = []  # the spans of the row being run (a stack: `documents` nests)


@contextlib.contextmanager
def documents(spans: Spans | None):
    """Run the row whose documents are `spans` (None: the layers run as their own forward)."""
    if spans is None:
        yield
        return
    _active.append(spans)
    try:
        yield
    finally:
        _active.pop()


def active_spans() -> Spans | None:
    """The spans of the row being run; None outside `documents(...)`."""
    return _active[-1] if _active else None


def current_spans() -> Spans:
    assert _active, "a varlen op (linear attention, or varlen attention) ran outside `documents(...)`"
    return _active[-1]


def fla_available() -> bool:
    try:
        import fla.modules.causal_conv1d  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------ the ops
# Custom ops: opaque to Dynamo (no graph break, no tracing into fla's Triton launchers), with fake
# implementations that give the output's shape. fla on CUDA when installed, else the PyTorch form.

def _use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and fla_available()


@torch.library.custom_op("dflash_mp::varlen_causal_conv1d", mutates_args=())
def varlen_causal_conv1d(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU of x [1, T, C] with weight [C, W], restarting at every span."""
    spans = current_spans()
    if _use_fla(x):
        from fla.modules.causal_conv1d import causal_conv1d

        y, _ = causal_conv1d(x, weight, activation="silu", cu_seqlens=spans.device, cu_seqlens_cpu=spans.cpu)
        return y.to(x.dtype).contiguous()  # the strides the fake promises: compiled code reads by them
    width = weight.shape[-1]
    out = []
    for s, e in spans.pairs():
        seg = x[:, s:e].transpose(1, 2).to(weight.dtype)
        y = F.conv1d(seg, weight.unsqueeze(1), padding=width - 1, groups=weight.shape[0])[..., : e - s]
        out.append(F.silu(y).transpose(1, 2))
    return torch.cat(out, dim=1).to(x.dtype).contiguous()


@varlen_causal_conv1d.register_fake
def _(x, weight):
    return x.new_empty(x.shape)  # contiguous, as the real output


@torch.library.custom_op("dflash_mp::varlen_gated_delta_rule", mutates_args=())
def varlen_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule (q, k L2-normalised inside) of q, k [1, T, H, K], v [1, T, HV, V] and
    g, beta [1, T, HV], its state zero at every span; value head j reads key head j // (HV / H)."""
    spans = current_spans()
    if _use_fla(q):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=spans.device,
                                      cu_seqlens_cpu=spans.cpu)
        return o.to(v.dtype).contiguous()
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    rule = _torch_chunk_gated_delta_rule()
    out = [rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], use_qk_l2norm_in_kernel=True)[0]
           for s, e in spans.pairs()]
    return torch.cat(out, dim=1).to(v.dtype).contiguous()


@varlen_gated_delta_rule.register_fake
def _(q, k, v, g, beta):
    return v.new_empty(v.shape)  # contiguous, as the real output (v itself is a strided view)


@functools.cache
def _torch_chunk_gated_delta_rule():
    """transformers' PyTorch chunked gated delta rule (unwrapped: with fla-core installed, transformers
    routes the wrapped name to fla, which has no CPU form)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    fn = modeling_qwen3_5.torch_chunk_gated_delta_rule
    return getattr(fn, "__wrapped__", fn)


# --------------------------------------------------------------------------------------- the layers
_VARLEN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
                 "out_proj")


def is_linear_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet")


def supports_varlen(module: nn.Module) -> bool:
    """Qwen3.5's Gated DeltaNet layout (Qwen3.5 and its MoE): the projections this module's varlen
    forward reads. Other layouts run one document at a time (`per_document`)."""
    return (all(hasattr(module, p) for p in _VARLEN_PARTS) and module.conv1d.bias is None
            and getattr(module, "activation", "silu") in ("silu", "swish"))


def varlen_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """What `module.forward` computes for each document of the row alone, in one pass over the row."""
    _, t, _ = hidden_states.shape
    mixed = varlen_causal_conv1d(module.in_proj_qkv(hidden_states), module.conv1d.weight.squeeze(1))
    q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(1, t, -1, module.head_k_dim)
    k = k.reshape(1, t, -1, module.head_k_dim)
    v = v.reshape(1, t, -1, module.head_v_dim)
    beta = module.in_proj_b(hidden_states).sigmoid()
    # In fp32, as transformers does (in fp16 the decay could reach -inf).
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(hidden_states).float() + module.dt_bias)
    o = varlen_gated_delta_rule(q, k, v, g, beta)
    z = module.in_proj_z(hidden_states)
    o = module.norm(o.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(o.reshape(1, t, -1))


def per_document(module: nn.Module, forward, hidden_states: torch.Tensor) -> torch.Tensor:
    """The module's own forward on each document's slice of the row: for linear-attention layouts
    `varlen_forward` does not know. A Python loop over the row's documents: `install` runs it outside
    any compiled graph (`_per_document_outside_graph`)."""
    return torch.cat([forward(hidden_states[:, s:e]) for s, e in current_spans().pairs()], dim=1)


@functools.cache
def _per_document_outside_graph():
    """`per_document` under torch.compiler.disable, made once on first use: as a decorator it would
    import Dynamo (a second) in every process that imports this module."""
    return torch.compiler.disable(per_document)


def install(module: nn.Module, cross_documents: bool = False) -> str:
    """Make `module` run packed rows document by document while `documents(...)` is active, and as
    itself otherwise (decoding with a cache). Returns how: 'varlen' or 'per-document'.
    `cross_documents=True` runs the row as one sequence: a leaking variant, for the packing tests."""
    forward = module.__dict__.get("_own_forward", module.forward)  # a second worker on the same model
    module._own_forward = forward
    how = "varlen" if supports_varlen(module) else "per-document"
    one_by_one = _per_document_outside_graph() if how == "per-document" else None

    def run(hidden_states, *args, **kwargs):
        if not _active:
            return forward(hidden_states, *args, **kwargs)
        if cross_documents:  # the row as one sequence, through the same kernels
            one = Spans(torch.tensor([0, hidden_states.shape[1]]), hidden_states.device)
            with documents(one):
                return varlen_forward(module, hidden_states) if how == "varlen" else forward(hidden_states)
        if how == "varlen":
            return varlen_forward(module, hidden_states)
        return one_by_one(module, forward, hidden_states)

    module.forward = run
    return how


def describe(hows: set[str], device: torch.device) -> str:
    """How the linear-attention layers run, for the log and the resolved-choices table."""
    if not hows:
        return "none"
    parts = []
    if "varlen" in hows:
        fla = device.type == "cuda" and fla_available()
        parts.append("one varlen call per layer (" + ("fla-core kernels" if fla else
                     "PyTorch, one document at a time: pip install -e '.[hybrid]' for fla-core's kernels"
                     if device.type == "cuda" else "PyTorch, one document at a time") + ")")
    if "per-document" in hows:
        parts.append("the layer's own forward, one document at a time (a layout without varlen support)")
    return "; ".join(parts)
