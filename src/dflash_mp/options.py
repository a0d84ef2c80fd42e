"""Config options whose `auto` value depends on the device."""

from __future__ import annotations

import torch


def resolve_auto(key: str, value: str, device: torch.device | str, *, cuda: str, cpu: str,
                 allowed: tuple[str, ...]) -> str:
    """`value` of option `key`: `auto` becomes `cuda` or `cpu` by the device's type; any other value
    must be one of `allowed`, or the error names the option, the bad value and the choices."""
    if value == "auto":
        return cuda if torch.device(device).type == "cuda" else cpu
    if value not in allowed:
        raise ValueError(f"{key}={value!r}: use auto or one of {', '.join(allowed)}.")
    return value
