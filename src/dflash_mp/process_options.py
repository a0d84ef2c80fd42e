"""What a role's process sets before its first GEMM and its first compile, read from the role's config
section (`target` or `train`, or a bench's arguments of the same names): cuBLAS's workspace
(`cublas_workspace`, blas.py) and how Inductor picks the reduction kernels' configs (`reduction_configs`,
reductions.py). The target's and drafter's runs, the dump, regeneration, evaluation and the benches all
start with `apply`."""

from __future__ import annotations

import torch

from . import blas, reductions


def apply(cfg, device: torch.device | str, section: str) -> None:
    """Apply `cfg.cublas_workspace` and `cfg.reduction_configs` (messages name them `section`.<field>) to
    this process: call it before the process's first GEMM and first compile."""
    blas.use_workspace(cfg.cublas_workspace, device, f"{section}.cublas_workspace")
    reductions.use_picks(cfg.reduction_configs, device, f"{section}.reduction_configs")


def describe(device: torch.device | str, role: str) -> list[tuple[str, str]]:
    """The resolved-choices table's rows for them (`role`: "target" or "drafter")."""
    return [(f"{role} cuBLAS workspace", blas.describe(device)),
            (f"{role} reduction kernels' configs", reductions.describe(device))]
