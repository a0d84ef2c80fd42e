"""What the project's Triton kernels (drafter and target) share: whether they can run on a device,
whether they load key/value tiles through tensor descriptors (TMA), and a launch that fits tiles
measured on an H200 to any GPU (retried with one pipeline stage fewer while the GPU's shared memory is
too small). Triton itself is imported on first use: the CPU build of torch comes without it."""

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


@functools.cache
def shared_memory(device: torch.device) -> int | None:
    """The bytes of shared memory a block may use on CUDA `device`, read from Triton (the figure it checks
    a launch against): 227 KiB on sm_90 and sm_100, 163 KiB on sm_80, 99 KiB on sm_86, sm_89 and sm_120.
    The kernels' bounds (block_attn / doc_attn SHARED_BYTES) are what they ask for on sm_80 and sm_120
    at any stage count, compiled on CPU (bench/kernel_resources.py); the 227 KiB GPUs run every preset.
    None off CUDA or where Triton cannot tell: the kernels are then taken to fit, as before."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        from triton.runtime import driver

        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception as e:  # noqa: BLE001 - a missing property must not stop a job the kernels may fit
        log.warning("could not read the shared memory of %s from Triton (%s: %s); taking the kernels to "
                    "fit", device, type(e).__name__, e)
        return None


def too_small(have: int | None, need: int, what: str) -> str | None:
    """Why a GPU with `have` bytes of shared memory a block cannot run kernels that need about `need`
    (None: it can, or `have` is unknown)."""
    if have is None or have >= need:
        return None
    return (f"a GPU with {have // 1024} KiB of shared memory a block: {what} need about {need // 1024} KiB "
            "there (bench/kernel_resources.py)")


def use_tma(flag: bool | None, *xs: torch.Tensor) -> bool:
    """Whether a kernel loads `xs`' tiles through tensor descriptors. `flag`, a module's USE_TMA: True or
    False forces the choice, None takes descriptors where the device has TMA; descriptors only where the
    layout allows them either way (a 16-byte aligned base and strides, all but the last, which is 1)."""
    aligned = all(x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
                  for x in xs)
    if flag is not None:
        return flag and aligned
    return aligned and has_tma(xs[0].device)


def key_value_tiles(flag: bool | None, k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple[bool, object, object]:
    """(TMA, what a kernel loads its key and value tiles from): descriptors with a box of `block_n` rows
    of one head where `use_tma(flag, k, v)`, else k and v themselves."""
    if use_tma(flag, k, v):
        return True, head_descriptor(k, block_n), head_descriptor(v, block_n)
    return False, k, v


def head_descriptor(x: torch.Tensor, block_n: int):
    """A tensor descriptor over `x` `[T, H, D]` whose box is `block_n` rows of one head (a kernel loads
    it as `tl.reshape(desc.load([n0, h, 0]), [block_n, D])`; rows past T come back as zeros)."""
    return descriptor(x, [block_n, 1, x.shape[2]])


def descriptor(x: torch.Tensor, block: list[int]):
    """A tensor descriptor over all of `x` whose box is `block` (out-of-range rows load as zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), block)


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
