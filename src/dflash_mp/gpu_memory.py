"""What this process's CUDA caching allocator holds: the figures the dashboards show, and giving back
what building a role left in its cache.

Building a role frees large tensors the allocator then keeps: the drafter's parameters, made in fp32
and copied into the optimizer's flat buffers; a random-weight target's layers and embedding, drawn in
fp32 and cast. Kept, that memory is lost to a process sharing the GPU, and the first steps'
activations are laid out beside it, so the process's peak holds both.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

GIB = 2**30


def give_back_cached(device: torch.device, what: str) -> int:
    """Return the allocator's cached, unused blocks to the GPU once `what` is built; logs and returns the
    bytes given back (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    before = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    log.info("%s built: %.2f GiB allocated, %.2f GiB reserved after giving back %.2f GiB its build left "
             "cached", what, torch.cuda.memory_allocated(device) / GIB, reserved / GIB,
             (before - reserved) / GIB)
    return before - reserved


def fresh_segments(device: torch.device) -> None:
    """Before allocating long-lived buffers: return the cached, unused blocks, so the buffers get segments
    of their own. Carved out of a block a temporary left cached (a random head's fp32 draw), a buffer
    would pin the rest of that block's segment, which no later give-back can return."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_scalars(device: torch.device) -> dict[str, float]:
    """GiB now reserved, and the peaks reserved and allocated since the process started (none off CUDA).
    Reserved counts a captured CUDA graph's pool, which allocated leaves out between captures."""
    if device.type != "cuda":
        return {}
    return {"memory/reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
            "memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB}
