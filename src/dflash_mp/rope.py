"""Rotary position embedding in transformers' rotate-half form, as the drafter's attention applies it:
dimension j is rotated with j + D/2."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[S, heads, D]` rotated by the tables cos/sin `[S, D]` of its S positions."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat([-x2, x1], dim=-1) * sin[:, None, :]
