"""What the project's Triton kernels (drafter and target) share: whether they can run on a device, and
a launch that fits tiles measured on an H200 to any GPU (retried with one pipeline stage fewer while
the GPU's shared memory is too small). Triton itself is imported on first use: the CPU build of torch
comes without it."""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

def available(device: torch.device) -> bool:
    """Whether Triton kernels can run on `device` (CUDA with Triton, or Triton's CPU interpreter)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def has_tma(device: torch.device) -> bool:
    """Whether `device` loads tiles through tensor descriptors in hardware (TMA: sm_90 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def input_precision(x: torch.Tensor) -> str:
    """The kernels' matmul input precision: "ieee" for fp32 inputs (fp32 stays fp32, not TF32)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: ignored for bf16/fp16 inputs


def last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    """`x` with its last dimension dense (the kernels address the others by their strides)."""
    return x if x.stride(-1) == 1 else x.contiguous()


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
