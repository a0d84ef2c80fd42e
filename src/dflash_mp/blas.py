"""cuBLAS's workspace in a target's process (`target.cublas_workspace`) and a drafter's
(`train.cublas_workspace`).

PyTorch hands cuBLAS a workspace, sized at the process's first GEMM from the environment variables
CUBLAS_WORKSPACE_CONFIG and CUBLASLT_WORKSPACE_SIZE. With one, cuBLAS runs five of the 8B target's seven
GEMMs a layer (q, k, v, o, down over 3072 rows) as kernels that first zero part of it: 170 memsets a
forward, each after an idle gap. Without one it picks other kernels of the same tiles and no memset, and
the forward is faster (BENCHMARKS.md, calls G4 and G5). The 8B drafter's step had 106 such memsets:
without a workspace the step is faster too (calls H2, H4 and, for the 27B preset's drafter, H11), its
losses and gradient norms equal to the bit.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

CHOICES = ("none", "torch")
# No workspace: CUBLAS_WORKSPACE_CONFIG is ":SIZE_KiB:COUNT" pairs (0 KiB here), CUBLASLT_WORKSPACE_SIZE KiB.
NO_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:1", "CUBLASLT_WORKSPACE_SIZE": "0"}


def use_workspace(choice: str, device: torch.device | str, setting: str) -> str:
    """Apply `setting` (`target.cublas_workspace` or `train.cublas_workspace`, the name its messages give)
    to this process: call it before the process's first GEMM (PyTorch reads the sizes once, then). `none`
    runs cuBLAS without a workspace, `torch` keeps PyTorch's sizes; a variable already in the environment
    is left as it is (e.g. a CUBLAS_WORKSPACE_CONFIG set for deterministic GEMMs). Nothing changes on CPU.
    Returns `describe(device)`."""
    if choice not in CHOICES:
        raise ValueError(f"{setting}={choice!r}: use none (cuBLAS without a workspace, the default: no memset "
                         "before a GEMM) or torch (PyTorch's workspace sizes).")
    if torch.device(device).type == "cuda" and choice == "none":
        for name, value in NO_WORKSPACE.items():
            os.environ.setdefault(name, value)
    how = describe(device)
    log.info("%s: cuBLAS workspace %s", setting, how)
    return how


def describe(device: torch.device | str) -> str:
    """The cuBLAS workspace this process's GEMMs get, from the environment (for the log and the
    resolved-choices table)."""
    if torch.device(device).type != "cuda":
        return "n/a (not CUDA)"
    found = {name: os.environ.get(name) for name in NO_WORKSPACE}
    if found == NO_WORKSPACE:
        return "none (" + ", ".join(f"{k}={v}" for k, v in NO_WORKSPACE.items()) + ")"
    set_ = {k: v for k, v in found.items() if v is not None}
    if not set_:
        return "PyTorch's sizes"
    return "as set in the environment: " + ", ".join(f"{k}={v}" for k, v in set_.items())
