"""Launching the project's Triton kernels with tiles measured on an H200 on any GPU: a launch whose
tiles need more shared memory than the GPU has is retried with one pipeline stage fewer."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_stages: dict[tuple, int] = {}  # (kernel, its constexprs, device) -> the pipeline stages that fit


def launch(kernel, grid, args, meta: dict, warps: int, stages: int, device: torch.device) -> None:
    """`kernel[grid](*args, **meta)`, with one pipeline stage fewer each time the GPU's shared memory
    is too small for the tiles (a GPU with less of it than the H200 the tiles were measured on)."""
    from triton.runtime.errors import OutOfResources

    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), tuple(sorted(meta.items())), warps,
           str(device))
    stages = _stages.get(key, stages)
    while True:
        try:
            kernel[grid](*args, **meta, num_warps=warps, num_stages=stages)
        except OutOfResources:
            if stages <= 1:
                raise
            log.warning("%s does not fit in shared memory with %d stages; trying %d", key[0], stages, stages - 1)
            stages -= 1
            continue
        _stages[key] = stages
        return
