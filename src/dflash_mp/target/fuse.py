"""The frozen target's decoder layers as fewer GEMMs and passes (`target.fuse`).

A Llama/Qwen layer projects one input several times (q_proj, k_proj, v_proj; gate_proj, up_proj) and
adds each half's output to the residual stream in a pass of its own. The target never trains, so its
weights can be laid out for speed once at load (each level includes the ones before it):

- `mlp`: gate_proj and up_proj become one `[2I, H]` weight (both parameters turn into views of it,
  nothing is duplicated): one GEMM of N = 2I, whose two halves SwiGLU reads;
- `mlp-residual`: the layer's second residual is added inside the down projection's GEMM (`addmm`,
  beta = 1) instead of in a pass over the stream;
- `layer`: q_proj, k_proj and v_proj become one weight too, and the first residual is added inside
  o_proj's GEMM.

Only modules laid out as Llama/Qwen's are fused (`mlp_fusable`, `layer_fusable`, `attention_fusable`),
and each fused layer is run against its own unfused forward on a probe row first (TargetWorker): a
class whose forward does more than its modules suggest keeps its own forward. The outputs differ from
the unfused ones by rounding only (bf16: one rounding of each sum instead of two).
"""

from __future__ import annotations

import functools
import logging
import sys

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

FUSE_CHOICES = ("layer", "mlp-residual", "mlp", "none")
LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}


def check_choice(fuse: str) -> str:
    if fuse not in FUSE_CHOICES:
        raise ValueError(f"target.fuse={fuse!r}: use {', '.join(FUSE_CHOICES)} (layer: q/k/v and gate/up as one GEMM "
                         "each, both residuals added in the GEMMs; mlp-residual: gate/up and the MLP's residual; "
                         "mlp: gate/up only; none: as loaded).")
    return fuse


def _plain_linear(m) -> bool:
    return isinstance(m, nn.Linear) and m.bias is None


def mlp_fusable(mlp: nn.Module) -> bool:
    """Whether `mlp` has bias-free gate_proj, up_proj (same shapes) and down_proj, and an act_fn."""
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (all(_plain_linear(p) for p in parts) and callable(getattr(mlp, "act_fn", None))
            and parts[0].weight.shape == parts[1].weight.shape
            and parts[2].in_features == parts[0].out_features)


def attention_fusable(attn: nn.Module) -> bool:
    """Whether `attn` is laid out as Llama/Qwen's attention: q/k/v/o projections (biases on all of q, k
    and v or none), optionally q_norm/k_norm, as many query heads as its config says, and a RoPE
    function in its modeling module."""
    children = {n for n, _ in attn.named_children()}
    if children not in (ATTENTION_CHILDREN, ATTENTION_CHILDREN | {"q_norm", "k_norm"}):
        return False
    q, k, v, o = (getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    config, head_dim = getattr(attn, "config", None), getattr(attn, "head_dim", None)
    return (all(isinstance(p, nn.Linear) for p in (q, k, v, o)) and len({p.bias is None for p in (q, k, v)}) == 1
            and k.weight.shape == v.weight.shape and config is not None and head_dim is not None
            and q.out_features == config.num_attention_heads * head_dim and hasattr(attn, "scaling")
            and callable(getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)))


def layer_fusable(layer: nn.Module) -> bool:
    """Whether `layer` has exactly a Llama/Qwen decoder layer's children, with a fusable MLP."""
    return {n for n, _ in layer.named_children()} == LAYER_CHILDREN and mlp_fusable(layer.mlp)


def _swiglu_down(mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) [+ residual] through the fused gate/up weight."""
    inter = mlp.down_proj.in_features
    gate_up = F.linear(x, mlp.gate_up_weight)
    h = mlp.act_fn(gate_up[..., :inter]) * gate_up[..., inter:]
    if residual is None:
        return mlp.down_proj(h)
    out = torch.addmm(residual.reshape(-1, residual.shape[-1]), h.reshape(-1, inter), mlp.down_proj.weight.t())
    return out.view(residual.shape)


def _plus(residual: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """residual + linear(x), the sum inside the GEMM."""
    flat = residual.reshape(-1, residual.shape[-1])
    if linear.bias is not None:
        flat = flat + linear.bias
    return torch.addmm(flat, x.reshape(-1, x.shape[-1]), linear.weight.t()).view(residual.shape)


def _attention_plus(attn: nn.Module, x: torch.Tensor, residual: torch.Tensor, attention_mask, position_embeddings,
                    **kwargs) -> torch.Tensor:
    """residual + Llama/Qwen attention(x), q/k/v through the fused weight (attention_fusable)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    shape = (*x.shape[:-1], -1, attn.head_dim)
    nq, nkv = attn.q_proj.out_features, attn.k_proj.out_features
    q, k, v = F.linear(x, attn.qkv_weight, attn.qkv_bias).split([nq, nkv, nkv], dim=-1)
    q, k, v = q.view(shape), k.view(shape), v.view(shape)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    interface = ALL_ATTENTION_FUNCTIONS[attn.config._attn_implementation]
    if hasattr(attn, "sliding_window"):  # passed where the class's own forward passes it (Qwen's, not Llama's)
        kwargs["sliding_window"] = attn.sliding_window
    out, _ = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    return _plus(residual, out.reshape(*x.shape[:-1], -1), attn.o_proj)


def _mlp_forward(self, x):
    return _swiglu_down(self, x, None)


def _layer_forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
    """The Llama/Qwen decoder layer's forward with its fused modules, the residuals inside the GEMMs."""
    x = self.input_layernorm(hidden_states)
    if hasattr(self.self_attn, "qkv_weight"):
        h = _attention_plus(self.self_attn, x, hidden_states, attention_mask, position_embeddings, **kwargs)
    else:
        h, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                              position_embeddings=position_embeddings, **kwargs)
        h = hidden_states + h
    return _swiglu_down(self.mlp, self.post_attention_layernorm(h), h)


@functools.cache
def _fused_class(cls: type, forward) -> type:
    """`cls` with `forward` (a subclass, so every fused module of a class shares one compiled graph)."""
    return type(f"Fused{cls.__name__}", (cls,), {"forward": forward, "_unfused_class": cls})


@torch.no_grad()
def _concat(owner: nn.Module, name: str, linears: list[nn.Linear], bias: bool = False) -> None:
    """Register `name` (the linears' weights, or biases, stacked along the output) on `owner`; the
    linears' own parameters become views of it."""
    attr = "bias" if bias else "weight"
    fused = torch.cat([getattr(m, attr) for m in linears])
    owner.register_buffer(name, fused, persistent=False)
    start = 0
    for m in linears:
        setattr(m, attr, nn.Parameter(fused[start:start + m.out_features], requires_grad=False))
        start += m.out_features


def _unconcat(owner: nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        owner._buffers.pop(name, None)


def fuse_module(module: nn.Module, level: str) -> nn.Module | None:
    """Fuse one decoder layer at `level` ("layer" falls back to "mlp" where the layer is not laid out
    as Llama/Qwen's). Returns the module whose class changed (the layer or its MLP), None if none."""
    mlp = getattr(module, "mlp", None)
    for m in (module, mlp):  # fused before (another worker over the same model): start from its own class
        if hasattr(type(m), "_unfused_class"):
            unfuse_module(m)
    attn = getattr(module, "self_attn", None)
    _unconcat(mlp, ("gate_up_weight",)) if mlp is not None else None
    _unconcat(attn, ("qkv_weight", "qkv_bias")) if attn is not None else None
    if level == "none" or mlp is None or not mlp_fusable(mlp):
        return None
    _concat(mlp, "gate_up_weight", [mlp.gate_proj, mlp.up_proj])
    if level == "mlp" or not layer_fusable(module):
        mlp.__class__ = _fused_class(type(mlp), _mlp_forward)
        return mlp
    if level == "layer" and attention_fusable(attn):
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        _concat(attn, "qkv_weight", qkv)
        if attn.q_proj.bias is not None:
            _concat(attn, "qkv_bias", qkv, bias=True)
        else:
            attn.qkv_bias = None
    module.__class__ = _fused_class(type(module), _layer_forward)
    return module


def unfuse_module(module: nn.Module) -> None:
    """Give a fused module its own class's forward back (the weights stay views of the fused ones)."""
    module.__class__ = module._unfused_class
    for m, names in ((getattr(module, "self_attn", None), ("qkv_weight", "qkv_bias")),
                     (getattr(module, "mlp", module), ("gate_up_weight",))):
        if m is not None:
            _unconcat(m, names)
            if "qkv_bias" in m.__dict__:
                del m.qkv_bias


def describe(fused: dict[int, nn.Module], level: str, layers: range) -> str:
    """One line for the log and the resolved-choices table."""
    if level == "none":
        return "none (target.fuse=none)"
    if not fused:
        return "none (no Llama/Qwen-style MLP in this target's layers)"
    kinds = sorted({_describe_one(m) for m in fused.values()})
    return f"{'; '.join(kinds)} ({len(fused)} of {len(layers)} layers)"


def _describe_one(m: nn.Module) -> str:
    if not hasattr(m, "self_attn"):
        return "gate/up as one GEMM"
    if not hasattr(m.self_attn, "qkv_weight"):
        return "gate/up as one GEMM, the MLP's residual added in down_proj"
    return "q/k/v and gate/up as one GEMM each, the residuals added in o_proj and down_proj"
