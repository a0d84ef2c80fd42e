"""How Inductor picks each compiled reduction kernel's config in a target's process
(`target.reduction_configs`) and a drafter's (`train.reduction_configs`).

Inductor generates several configs for a reduction kernel (rows per program, warps) and, by default,
times them on the GPU the first time the kernel runs, keeping the fastest for good: the pick is saved
with the compiled graph and every later process that loads the graph inherits it. For the kernels that
normalise the queries and keys per head and apply RoPE (rows of 128), the timings do not separate the
configs reliably, and the pick varies between processes compiling the same code: the same kernels of the
8B target and drafter ran up to three times as long after some compiles as after others, and a job's
restarts load its graphs, slow picks included (BENCHMARKS.md, calls I1 and I2).

`heuristic` (the default on CUDA) has Inductor pick one config per reduction from the kernel's shape,
without timing (its `force_filter_reduction_configs`: drop configs it knows run badly, then take the
second largest block, warp count and rows per program): every compile gets the same kernels, and the
query/key kernels run as fast as the best timed picks did (BENCHMARKS.md, calls I2-I4); the target's two
large RMSNorm kernels run slightly slower than theirs. `timed` keeps Inductor's timing. Pointwise kernels
are another matter: `UNTIMED_POINTWISE`, which the target's layers and the drafter's optimizer compile with.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# Inductor options for a compile whose pointwise kernels take their first config untimed (1024 elements,
# 4 warps). Timed, Inductor runs two configs of each at its first call and keeps the faster: for the 8B
# target's SwiGLU the pick came out either way in runs of the same code, the slower taking half again as
# long (BENCHMARKS.md, issue 31); for the optimizer's update it ran them on clones of the buffers it
# writes, which laid out 2.6 GiB of segments more at the 27B drafter's first step for the same kernel time
# (call Q14). The drafter's own layers keep the timing: both ways they got kernels of the same time (call V6).
UNTIMED_POINTWISE = {"triton.autotune_pointwise": False}

CHOICES = ("heuristic", "timed")
FLAG = "force_filter_reduction_configs"  # in torch._inductor.config.test_configs (torch 2.11 and 2.13)


def _configs():
    from torch._inductor import config

    return config.test_configs


def use_picks(choice: str, device: torch.device | str, setting: str) -> str:
    """Apply `setting` (`target.reduction_configs` or `train.reduction_configs`, the name its messages give)
    to this process's Inductor: call it before the process compiles (the choice is baked into each kernel
    as it is generated, and is part of the compiled graphs' cache key). Nothing changes off CUDA, where
    Inductor generates C++. Returns `describe(device)`."""
    if choice not in CHOICES:
        raise ValueError(f"{setting}={choice!r}: use heuristic (Inductor picks each reduction kernel's config "
                         "from its shape, the same in every compile: the default) or timed (Inductor times the "
                         "configs on the GPU at the kernel's first run).")
    if torch.device(device).type == "cuda" and hasattr(_configs(), FLAG):
        setattr(_configs(), FLAG, choice == "heuristic")
    how = describe(device)
    log.info("%s: reduction configs %s", setting, how)
    return how


def describe(device: torch.device | str) -> str:
    """How this process's compiled reduction kernels get their configs (for the log and the
    resolved-choices table)."""
    if torch.device(device).type != "cuda":
        return "n/a (not CUDA)"
    if not hasattr(_configs(), FLAG):
        return f"timed (this torch {torch.__version__} has no {FLAG})"
    if getattr(_configs(), FLAG):
        return "heuristic (one config per reduction from its shape, untimed)"
    return "timed (Inductor times each reduction's configs at its first run)"
