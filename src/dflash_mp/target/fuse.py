"""The frozen target's MLP gate and up projections as one GEMM (`target.fuse_mlp`, on by default).

A Llama/Qwen MLP projects its input twice, `gate_proj` and `up_proj` (two GEMMs of N = I), and
SwiGLU then reads both outputs. The target never trains, so its weights can be laid out for speed
once at load: the two become one `[2I, H]` weight (both parameters turn into views of it, nothing
is duplicated), one GEMM of N = 2I whose two halves SwiGLU reads from one tensor. On the 8B target
at T = 3072 (H200, BENCHMARKS.md) the GEMM is 0.2 ms and SwiGLU 0.9 ms faster per forward.

Only MLPs laid out as Llama/Qwen's are fused (`mlp_fusable`), and each fused layer is run against
its own unfused forward on a probe row first (TargetWorker): a class whose forward does more than
its modules suggest keeps its own. Every output element is the same dot product as before.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def mlp_fusable(mlp: nn.Module) -> bool:
    """Whether `mlp` has bias-free gate_proj, up_proj (same shapes) and down_proj, and an act_fn."""
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(p, nn.Linear) and p.bias is None for p in parts)
            and callable(getattr(mlp, "act_fn", None)) and parts[0].weight.shape == parts[1].weight.shape
            and parts[2].in_features == parts[0].out_features)


def _fused_forward(self, x):
    """down(act(gate(x)) * up(x)) through the fused gate/up weight."""
    gate_up = F.linear(x, self.gate_up_weight)
    inter = self.down_proj.in_features
    return self.down_proj(self.act_fn(gate_up[..., :inter]) * gate_up[..., inter:])


@functools.cache
def _fused_class(cls: type) -> type:
    """`cls` with the fused forward (a subclass: every fused MLP of a class shares one compiled graph)."""
    return type(f"Fused{cls.__name__}", (cls,), {"forward": _fused_forward, "_unfused_class": cls})


@torch.no_grad()
def fuse_mlp(layer: nn.Module) -> nn.Module | None:
    """Fuse decoder layer `layer`'s MLP if it is laid out as Llama/Qwen's; returns it, else None. An MLP
    fused before (another worker over the same model) is fused again from its own class."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return None
    unfuse_mlp(mlp)
    if not mlp_fusable(mlp):
        return None
    gate, up = mlp.gate_proj, mlp.up_proj
    fused = torch.cat([gate.weight, up.weight])
    mlp.register_buffer("gate_up_weight", fused, persistent=False)
    gate.weight = nn.Parameter(fused[:gate.out_features], requires_grad=False)
    up.weight = nn.Parameter(fused[gate.out_features:], requires_grad=False)
    mlp.__class__ = _fused_class(type(mlp))
    return mlp


def unfuse_mlp(mlp: nn.Module) -> None:
    """Give a fused MLP its own class's forward back (its weights stay views of the fused one)."""
    if hasattr(type(mlp), "_unfused_class"):
        mlp.__class__ = type(mlp)._unfused_class
        mlp._buffers.pop("gate_up_weight", None)


def describe(fused: dict[int, nn.Module], enabled: bool, layers: range) -> str:
    """One line for the log and the resolved-choices table."""
    if not enabled:
        return "no (target.fuse_mlp=false)"
    if not fused:
        return "no (no Llama/Qwen-style MLP in this target's layers)"
    return f"gate/up as one GEMM ({len(fused)} of {len(layers)} layers)"
