"""A frozen layer's RMSNorm weights folded into the projections that read the norm's output.

In a layer laid out as Llama's, each RMSNorm's output is read by matmuls only: q/k/v after the input
norm, gate/up after the one before the MLP. For a row x, `norm(x) = w * x * r(x)` with the per-row
`r(x) = rsqrt(mean(x^2) + eps)`, so a projection of it is

    W norm(x) = r(x) * ((W diag(w)) x)

The weight `W diag(w)` is computed once, and the matmul reads x itself: the normed rows are never
written. Compiled, the norm kernel then writes the residual stream and r (4 bytes a row) instead of
also the normed [T, H] rows (25 MB a norm at the 8B target's T = 3072, 1.7 GB a forward over 34
layers), and r is applied where the projection's output is read anyway: in the q/k norm and RoPE
kernel, the SwiGLU kernel, and one pass over v (its readers are the attention kernel).

Measured at 8B shapes on an H100 (BENCHMARKS.md, call X1): the add-and-norm kernels saved 0.67 ms a
forward, but the q/k kernels that now scale by r took 0.52 ms more and the pass over v 0.14, so the
kernels' sum did not move; the forward, timed call by call, was 1.45-2.03 ms faster, while the profiler's
back-to-back forwards ran busier. Hence `target.fold_norms` stays off until timed back to back.

The product is the same up to where bf16 rounds (the folded weight once, the matmul's output before
r instead of after); TargetWorker keeps a layer folded only where its folded output equals its own to
that rounding (`check_compiled`). A norm of another form (Gemma's `1 + w`, a centred LayerNorm) is
not folded: `normed_weight` reads the norm's arithmetic off a probe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (norm, the modules that read its output) in a layer laid out as Llama's.
READERS = (("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj")),
           ("post_attention_layernorm", "mlp", ("gate_proj", "up_proj")))


class NormedLinear(nn.Module):
    """`linear(norm(x))` for an RMSNorm of weight w and epsilon `eps`, its weight `W diag(w)`: the
    matmul reads x, and its output is scaled by r(x) (module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        y = (F.linear(x, self.weight) * r).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, eps={self.eps}"


def normed_weight(norm: nn.Module, hidden: int) -> tuple[torch.Tensor, float] | None:
    """(w, eps) of an RMSNorm that computes `w * x * rsqrt(mean(x^2) + eps)` (a missing weight reads as
    ones), checked on a probe in float32; None for any other norm."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    w = getattr(norm, "weight", None)
    if not isinstance(eps, float) or (w is not None and tuple(w.shape) != (hidden,)):
        return None
    w = torch.ones(hidden, device=_device(norm)) if w is None else w.detach().float()
    x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(0)).to(w.device)
    try:
        with torch.no_grad():
            got = _as(norm, torch.float32)(x)
    except Exception:  # noqa: BLE001 - a norm that cannot run on its own is not one to fold
        return None
    want = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (w, eps) if torch.allclose(got.float(), want, rtol=1e-4, atol=1e-5) else None


def _device(m: nn.Module) -> torch.device:
    return next((t.device for t in m.parameters()), torch.device("cpu"))


def _as(norm: nn.Module, dtype: torch.dtype):
    """The norm's forward with its weight (if any) in `dtype`, the module itself left as it is."""
    w = getattr(norm, "weight", None)
    if w is None or w.dtype == dtype:
        return norm
    return lambda x: torch.func.functional_call(norm, {"weight": w.detach().to(dtype)}, (x,))


class Fold:
    """The norms of one layer folded into their readers (`fold_layer`); `undo()` puts the layer back as it
    was. Holding a Fold keeps the replaced modules (and their weights) alive: drop it to free them."""

    def __init__(self, swapped: list[tuple[nn.Module, str, nn.Module]]):
        self.swapped = swapped  # (parent, attribute, the module it held), in the order they were replaced

    def undo(self) -> None:
        for parent, name, module in reversed(self.swapped):
            setattr(parent, name, module)
        self.swapped = []


def fold_layer(layer: nn.Module, hidden: int) -> Fold | None:
    """Fold each of the layer's RMSNorms into the Linear modules that read its output (READERS), where
    the norm is an RMSNorm (`normed_weight`) and its readers are bias-free or biased Linears of `hidden`
    inputs; the folded weights are new tensors, the norm becomes an Identity. None: nothing folded."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for norm_name, block_name, reader_names in READERS:
        norm, block = getattr(layer, norm_name, None), getattr(layer, block_name, None)
        readers = [getattr(block, n, None) for n in reader_names] if block is not None else []
        linear = all(type(m) is nn.Linear and m.in_features == hidden for m in readers)
        if norm is None or not readers or not linear:
            continue
        got = normed_weight(norm, hidden)
        if got is None:
            continue
        w, eps = got
        for name, m in zip(reader_names, readers):
            weight = (m.weight.float() * w.to(m.weight.device)).to(m.weight.dtype)
            swapped.append((block, name, m))
            setattr(block, name, NormedLinear(weight, None if m.bias is None else m.bias.detach(), eps))
        swapped.append((layer, norm_name, norm))
        setattr(layer, norm_name, nn.Identity())
    return Fold(swapped) if swapped else None
