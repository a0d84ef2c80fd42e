"""AdamW over flat buffers, with fp32 master weights and working weights in the compute dtype.

Everything the optimizer keeps lives in one flat buffer per kind, allocated once:

- `master` (fp32): the weights AdamW updates, and what checkpoints hold;
- `work` (compute dtype): the weights the model computes with. Every trainable parameter's data is
  a view into it, so the forward reads bf16 weights as they are (no per-step fp32 -> bf16 cast)
  and the backward produces bf16 gradients (no cast back). In fp32, `work` is `master`;
- `exp_avg`, `exp_avg_sq` (fp32): the moments.

With bf16 working weights the master is kept split (`split_master`, the default): a bf16 number is
the upper 16 bits of an fp32 one, so `work` holds the master's upper half, rounded to nearest, and
`low` (int16) the signed rest, `master = (work << 16) + low` bit for bit. The update reads and
writes 2 + 2 bytes of master and working weight instead of 4 + 4 + 2: 26 bytes a parameter instead
of 28, and 2 bytes less memory a parameter (BENCHMARKS.md, calls F1-F4). The only difference from a
separate fp32 master is how an exact tie rounds: half away from zero (the split needs it: `low` then
fits 16 bits) instead of half to even, where the lower 16 bits are 0x8000 (1 value in 65,536 of random
bits).

The gradients reach the update in one of two ways. Either way autograd leaves each parameter's
gradient in `.grad`, a fresh tensor (`.grad` is None when the step's first backward starts, so
nothing is added into old memory); later backwards of the same step (gradient accumulation) add
into it.

- Direct (one replica, the default there): the update reads the `.grad` tensors themselves, one
  per-parameter view of each buffer beside each, and then drops them (kept alive until the side
  stream's update that reads them has run). No flat gradient buffer exists: no copy per step
  (~2 GB read and written at 8B) and ~2 GB less memory.
- Flat (data parallel, `overlap_reduce`, CUDA graphs): a `grad` buffer (compute dtype) that the
  all-reduce sums over the group as one collective, outside any compiled region. `collect()`
  writes the `.grad` tensors into it on the first backward after a step and adds them on later
  ones; writing instead of adding saves a read and a zeroing pass. The `.grad` tensors are dropped
  at once: with CUDA graphs they may live in a graph's output pool, which the next replay
  overwrites, so the trainer keeps this scheme there.

One step is one reduction (the global gradient norm, accumulated in fp32) and one elementwise
pass that reads the gradient, master weights and moments and writes master, moments and the
working copy: the clip factor, the data-parallel mean and the skip of non-finite steps are folded
into it. Compiled, each flat slice (direct: each parameter) is one kernel at memory speed; the
same function runs eagerly on CPU.

The pass can run in segments (contiguous runs of parameters, e.g. one per decoder layer) on a
side CUDA stream: it is memory-bound, and the next step's forward, which is matmul-bound, needs
the segments one after the other. `wait(module)` makes the compute stream wait for the segment
that holds a module's weights, just before the module runs; whatever reads the weights or the
optimizer state outside the training step waits for all of them first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from .gpu_memory import fresh_segments
from .reductions import UNTIMED_POINTWISE


def master_of(work: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a split pair (bf16 `work`, int16 `low`; see the module docstring)."""
    return ((work.view(torch.int16).to(torch.int32) << 16) + low.to(torch.int32)).view(torch.float32)


def halves_of(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(work, low) of an fp32 `master`: its upper half rounded to nearest (a tie away from zero: adding
    half of the lower half's range to the bits carries into the upper half), and the signed rest."""
    bits = master.view(torch.int32)
    high = (bits + 0x8000) >> 16
    return high.to(torch.int16).view(torch.bfloat16), (bits - (high << 16)).to(torch.int16)


class _JoinedMaster(Mapping):
    """FlatAdamW.named_master of a split master: name -> (work, low) views, joined on each read."""

    def __init__(self, halves: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self._halves = halves

    def __getitem__(self, name: str) -> torch.Tensor:
        return master_of(*self._halves[name])

    def __iter__(self):
        return iter(self._halves)

    def __len__(self) -> int:
        return len(self._halves)


def adamw_update(master, grad, exp_avg, exp_avg_sq, work, step, lr, divisor, skip, *,
                 beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step in place over flat buffers; `torch.optim.AdamW`'s arithmetic.

    The gradient used is `grad / divisor`. `step` counts applied updates, this one included (the
    caller advances it: a step may be applied in several segments); `lr`, `divisor` and `skip` are
    0-d tensors (no recompile when they change). `skip == 1` leaves every buffer as it was, so a
    non-finite gradient costs one step, not NaN weights. `work` (the low-precision copy) may be
    None: the weights are the master. An int16 `master` is the split master's lower half, beside
    `work` its upper half (halves_of).
    """
    keep = skip > 0
    low = master if master.dtype == torch.int16 else None
    if low is not None:
        master = master_of(work, low)
    g = grad.float() / divisor
    m = torch.lerp(exp_avg, g, 1 - beta1)
    v = exp_avg_sq * beta2 + (1 - beta2) * g * g
    step_size = lr / (1 - beta1**step)
    denom = v.sqrt() / torch.sqrt(1 - beta2**step) + eps
    p = master * (1 - lr * weight_decay) - step_size * m / denom
    p = torch.where(keep, master, p)
    exp_avg.copy_(torch.where(keep, exp_avg, m))
    exp_avg_sq.copy_(torch.where(keep, exp_avg_sq, v))
    if low is not None:  # a kept step splits back into the very same halves
        high, rest = halves_of(p)
        work.copy_(high)
        low.copy_(rest)
        return
    master.copy_(p)
    if work is not None:
        work.copy_(p)


def adamw_update_each(masters, grads, exp_avgs, exp_avg_sqs, works, step, lr, divisor, skip, **hyper) -> None:
    """`adamw_update` over lists: one flat slice each (flat scheme) or one view per parameter beside
    its `.grad` (direct). The one function the optimizer compiles, so segments of equal shapes (the
    decoder layers) share one graph in either scheme. `works` may be None (see adamw_update)."""
    for i, master in enumerate(masters):
        adamw_update(master, grads[i], exp_avgs[i], exp_avg_sqs[i], None if works is None else works[i],
                     step, lr, divisor, skip, **hyper)


# Per-tensor L2 norms accumulated in fp32 in one multi-tensor kernel, where this torch's
# _foreach_norm takes a dtype; else one vector_norm per tensor, the same sums.
_FOREACH_NORM_DTYPE = "dtype" in str(torch.ops.aten._foreach_norm.Scalar._schema)


def _norms_fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if _FOREACH_NORM_DTYPE:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]


def held_bytes_per_param(dtype: torch.dtype, split_master: bool = True, replicas: int = 1) -> int:
    """Bytes FlatAdamW holds per trainable parameter, the gradient included (`FlatAdamW.held_bytes`):
    the master (fp32, or with bf16 working weights split: its int16 lower half), the working weights
    (none in fp32: they are the master), the gradient in the working dtype (`.grad` or the flat
    buffer), the two fp32 moments, and with 2+ replicas of a low-precision dtype the fp32 buffer the
    gradients are summed in."""
    size = dtype.itemsize
    master = 2 if split_master and dtype == torch.bfloat16 else 4
    work = 0 if dtype == torch.float32 else size
    summed = 4 if replicas > 1 and dtype != torch.float32 else 0
    return master + work + size + 4 + 4 + summed


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all `tensors` together, accumulated in fp32 (0-d)."""
    return torch.linalg.vector_norm(torch.stack(_norms_fp32(tensors)))


def global_norm_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`global_norm` as sums of squares, the form the optimizer compiles: Inductor reduces each tensor
    in its own kernels at memory speed, where `_foreach_norm` runs ~50 launches of fixed-size chunks,
    which reached about half the copy ceiling on the H200."""
    return torch.stack([t.float().square().sum() for t in tensors]).sum().sqrt()


def replicas(group) -> int:
    """Data-parallel replicas in `group` (None: no data parallelism, one replica or a one-process
    reference)."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


class FlatAdamW:
    """AdamW with clipping for `named_params` ((name, parameter) pairs), which it rebinds: their
    data become views of its flat buffers (see the module docstring). Build it before compiling
    the model; call `collect()` after every backward.

    `segments`: lists of parameter names, in the order to update them; each list a contiguous run
    of `named_params`, together all of them (default: one segment). `side_stream` (CUDA only):
    the segments run on a side stream; see `wait`.

    `overlap_reduce` (data parallel, written gradients): the segments are also the buckets of the
    gradient all-reduce, as DDP's are. A hook on each parameter moves its gradient into the buffer
    the moment backward has it, and a segment whose gradients are all in is summed over the group
    at once, asynchronously, while backward goes on with the layers before it; `allreduce()` then
    only waits. Each element is summed exactly as the one collective over the buffer sums it.

    `write_grads=False` keeps the older scheme for comparison: each `.grad` is a view of the
    buffer, autograd adds into it and the buffer is zeroed after each step.

    `direct_grads`: with one replica (where `overlap_reduce` has nothing to sum) and written gradients, the update reads
    the `.grad` tensors and no flat gradient buffer is allocated (`direct`; the module docstring's
    direct scheme). False keeps the flat buffer: the caller's choice under CUDA graphs.

    `split_master` (bf16 working weights): the master is kept as `work` and its int16 lower half `low`
    (the module docstring); False keeps a separate fp32 master, for comparison."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], *, lr: float, betas: tuple[float, float],
                 weight_decay: float,
                 eps: float = 1e-8, dtype: torch.dtype = torch.float32, group=None, compiled: bool = False,
                 write_grads: bool = True, segments: list[list[str]] | None = None, side_stream: bool = False,
                 overlap_reduce: bool = False, direct_grads: bool = True, split_master: bool = True):
        if not named_params:
            raise ValueError("FlatAdamW got no parameters; is every drafter weight frozen?")
        self.names = [n for n, _ in named_params]
        self.params = params = [p for _, p in named_params]
        self.lr = lr
        self.hyper = dict(beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps),
                          weight_decay=float(weight_decay))
        self.group = group
        self.world = replicas(group)
        device = params[0].device
        self._offsets = [0]  # parameter i lives at [_offsets[i], _offsets[i + 1]) of every flat buffer
        for p in params:
            self._offsets.append(self._offsets[-1] + p.numel())
        n = self._offsets[-1]
        f32 = dict(dtype=torch.float32, device=device)
        self.split = split_master and dtype == torch.bfloat16
        fresh_segments(device)  # the flat buffers live as long as the run: segments of their own
        # The master as the update reads and writes it: the fp32 buffer, or (split) the lower half,
        # filled one parameter at a time (no whole-size temporaries).
        self._master = torch.empty(n, dtype=torch.int16 if self.split else torch.float32, device=device)
        self.work = self._master if dtype == torch.float32 else torch.empty(n, dtype=dtype, device=device)
        self._write_master([p.detach() for p in params])
        self.write_grads = write_grads
        # Nothing to sum over a group: the update can read the gradients where autograd leaves them.
        self.direct = direct_grads and write_grads and self.world == 1
        # The flat scheme's gradient, and each parameter's view of it (None, [] when direct).
        self.grad = None if self.direct else torch.zeros(n, dtype=dtype, device=device)
        self.grad_views = [] if self.direct else self._views(self.grad)
        self._fresh = True  # no backward since the last step: the next collect() writes
        for i, (p, w) in enumerate(zip(params, self._views(self.work))):
            p.data = w
            p.grad = None if write_grads else self.grad_views[i]
        self.exp_avg = torch.zeros(n, **f32)
        self.exp_avg_sq = torch.zeros(n, **f32)
        self.step = torch.zeros((), **f32)  # applied updates (skipped steps do not count)
        self._lr = torch.zeros((), **f32)
        # The data-parallel sum of bf16 gradients is taken in fp32: NCCL adds in the buffer's dtype.
        low = dtype != torch.float32 and self.world > 1
        self._reduce = torch.empty(n, **f32) if low else None
        self._update = adamw_update_each
        if compiled:
            self._update = torch.compile(adamw_update_each, dynamic=False, fullgraph=True,
                                         options=UNTIMED_POINTWISE)
        self.grad_norm = torch.compile(global_norm_sums, dynamic=False, fullgraph=True) if compiled else global_norm
        # One compiled graph per distinct segment shape (offsets do not recompile).
        self._segments = self._slices(segments or [self.names])
        self._stream = torch.cuda.Stream(device) if side_stream and device.type == "cuda" else None
        self._pending: list[torch.cuda.Event | None] = [None] * len(self._segments)
        # Direct: each segment's gradients, held until the compute stream has waited for the update
        # that reads them on the side stream (freed earlier, the allocator could hand their memory
        # to the compute stream while the update still reads it).
        self._held: list[list[torch.Tensor] | None] = [None] * len(self._segments)
        self._zeros: dict[int, torch.Tensor] = {}  # direct: the gradient of a weight backward did not reach
        self._waits: dict[str, list[int]] = {}
        # Bucketed all-reduce during backward (see the class docstring).
        self._overlap = overlap_reduce and self.world > 1 and write_grads
        self._handles: list = []  # this backward's launched bucket reductions
        self.reduced_in_backward: list[int] = []  # the last backward's buckets, in the order its hooks sent them
        if self._overlap:
            index = {n: i for i, n in enumerate(self.names)}
            self._bucket_of = [0] * len(self.names)
            for b, (names, _) in enumerate(self._segments):
                for n in names:
                    self._bucket_of[index[n]] = b
            self._bucket_span = [(min(index[n] for n in names), max(index[n] for n in names) + 1)
                                 for names, _ in self._segments]
            self._left = [0] * len(self._segments)
            self._landed = [False] * len(self.names)
            self._armed = False
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i, p))

    def _slices(self, segments: list[list[str]]) -> list[tuple[set[str], list]]:
        """Per segment: its names and its lists of buffer slices, in adamw_update_each's argument
        order: one flat slice each, or (direct) one view per parameter, the gradients left None
        (each step's `.grad` tensors, from `_seg_ids`)."""
        index = {n: i for i, n in enumerate(self.names)}
        unknown = [n for seg in segments for n in seg if n not in index]
        listed = sorted(index[n] for seg in segments for n in seg if n in index)
        if unknown or listed != list(range(len(self.names))):
            raise ValueError(f"optimizer segments must list every trainable parameter once; unknown: {unknown[:3]}, "
                             f"listed {len(listed)} of {len(self.names)}")
        offs = self._offsets
        out = []
        self._seg_ids = []  # each segment's run of parameter indices
        views = {k: self._views(getattr(self, k)) for k in ("_master", "work", "exp_avg", "exp_avg_sq")} \
            if self.direct else {}
        for seg in segments:
            ids = sorted(index[n] for n in seg)
            if ids != list(range(ids[0], ids[-1] + 1)):
                raise ValueError(f"optimizer segment {seg[:2]}... is not a contiguous run of the parameters "
                                 f"({self.names[ids[0]]} .. {self.names[ids[-1]]} has gaps)")
            a, b = ids[0], ids[-1] + 1
            self._seg_ids.append(range(a, b))
            if self.direct:
                work = None if self.work is self._master else views["work"][a:b]
                bufs = [views["_master"][a:b], None, views["exp_avg"][a:b], views["exp_avg_sq"][a:b], work]
            else:
                lo, hi = offs[a], offs[b]
                work = None if self.work is self._master else [self.work[lo:hi]]
                bufs = [[self._master[lo:hi]], [self._grad()[lo:hi]], [self.exp_avg[lo:hi]],
                        [self.exp_avg_sq[lo:hi]], work]
            out.append((set(seg), bufs))
        return out

    def _write_master(self, values: list[torch.Tensor]) -> None:
        """Set the master and the working weights from `values`, one per parameter, written one parameter
        at a time (split: each value's halves, with no temporaries the size of all the weights)."""
        separate = self.work is not self._master  # fp32 working weights are the master itself
        for master, work, v in zip(self._views(self._master), self._views(self.work), values):
            if self.split:
                high, low = halves_of(v.to(device=master.device, dtype=torch.float32).contiguous())
                work.copy_(high)
                master.copy_(low)
            else:
                master.copy_(v)
                if separate:
                    work.copy_(master)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[lo:hi].view_as(p) for p, lo, hi in zip(self.params, self._offsets, self._offsets[1:])]

    @property
    def on_side_stream(self) -> bool:
        """Whether the updates run on a side stream (see `wait`)."""
        return self._stream is not None

    def wait(self, module: str) -> None:
        """Make the current stream wait until the weights under `module` (a name prefix such as
        "layers.0") have their update of the last step; free where they have it already."""
        ids = self._waits.get(module)
        if ids is None:
            pre = module + "."
            ids = self._waits[module] = [i for i, (names, _) in enumerate(self._segments)
                                         if any(n == module or n.startswith(pre) for n in names)]
        for i in ids:
            if self._pending[i] is not None:
                torch.cuda.current_stream().wait_event(self._pending[i])
                self._held[i] = None  # freed after the wait in this stream's order: safe to reuse

    def wait_all(self) -> None:
        """Make the current stream wait for every update of the last step (before reading the
        weights, the gradient buffer or the optimizer state outside the training step)."""
        for i, event in enumerate(self._pending):
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
                self._pending[i] = None
                self._held[i] = None

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        """Backward has parameter i's gradient: into the buffer, and its bucket summed once complete."""
        if not self._fresh:  # the buckets of the first backward are summed already
            raise RuntimeError("overlap_reduce sums each backward's gradients as they come: one backward per "
                               "optimizer step (no gradient accumulation)")
        if not self._armed:  # this backward's first gradient: the last update may still read the buffer
            self._armed = True
            self.wait_all()
            self._left = [hi - lo for lo, hi in self._bucket_span]
            self._landed = [False] * len(self.names)
            self._handles = []
            self.reduced_in_backward = []
        self.grad_views[i].copy_(p.grad)
        p.grad = None
        self._landed[i] = True
        b = self._bucket_of[i]
        self._left[b] -= 1
        if self._left[b] == 0:
            self.reduced_in_backward.append(b)
            self._reduce_bucket(b)

    def _reduce_bucket(self, b: int) -> None:
        lo, hi = (self._offsets[i] for i in self._bucket_span[b])
        if self._reduce is not None:
            self._reduce[lo:hi].copy_(self.grad[lo:hi])
        self._handles.append(dist.all_reduce(self._grad()[lo:hi], group=self.group, async_op=True))

    def collect(self) -> None:
        """Move the gradients backward left in `.grad` into the flat buffer (no host sync); direct,
        they stay where they are (a later backward adds into them)."""
        self.wait_all()  # the last update read the buffer
        if not self.write_grads or self.direct:
            return
        if self._overlap and self._armed:  # the hooks moved them; zero the rest, sum what is left
            self._armed = False
            for i, v in enumerate(self.grad_views):
                if not self._landed[i]:  # a weight this backward did not reach: its gradient is zero
                    v.zero_()
            for b, left in enumerate(self._left):
                if left > 0:
                    self._reduce_bucket(b)
            self._fresh = False
            return
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        pairs = [(v, g) for v, g in zip(self.grad_views, grads) if g is not None]
        if pairs:
            views, got = zip(*pairs)
            (torch._foreach_copy_ if self._fresh else torch._foreach_add_)(list(views), list(got))
        if self._fresh:
            for v, g in zip(self.grad_views, grads):
                if g is None:  # a weight this backward did not reach: its gradient is zero
                    v.zero_()
        self._fresh = False

    def allreduce(self) -> None:
        """Sum the gradient over the group; the division by its size happens inside the update."""
        if self.world == 1:
            return
        if self._handles:  # launched bucket by bucket during backward (overlap_reduce)
            for h in self._handles:
                h.wait()
            self._handles = []
            return
        if self._reduce is not None:
            self._reduce.copy_(self.grad)
        dist.all_reduce(self._grad(), group=self.group)

    def _grad(self) -> torch.Tensor:
        return self._reduce if self._reduce is not None else self.grad

    def _take_grads(self) -> list[torch.Tensor]:
        """Direct: the `.grad` tensors (zeros for a weight backward did not reach), each `.grad`
        then set to None so that the next backward writes fresh tensors."""
        out = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                g = self._zeros.get(i)
                if g is None:
                    g = self._zeros[i] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            else:
                p.grad = None
            out.append(g)
        return out

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient since the last step, shaped like it: views of the flat buffer,
        or (direct) the `.grad` tensors, zeros where backward did not reach. For checks outside
        the step."""
        self.wait_all()
        if not self.direct:
            return list(self.grad_views)
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def load_lr(self) -> None:
        """Copy `self.lr` into the 0-d tensor the update reads (`step_` does it unless told not to)."""
        self._lr.fill_(self.lr)

    def reset_grads(self) -> None:
        """Forget the gradients of a step that never ran (a failed CUDA graph capture left them)."""
        self._zeros.clear()
        self._held = [None] * len(self._segments)
        self._fresh = True

    def step_(self, clip: float, load_lr: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip to global norm `clip` (0: no clipping) and update at `self.lr`; the next backward's
        gradients then replace this step's. Returns the pre-clip norm of the group-mean gradient and 1.0 if
        the step was skipped, as 0-d tensors. No host sync. `load_lr=False`: the caller has called
        `load_lr()` (a captured step must not record the rate's value)."""
        self.wait_all()
        if self.direct:
            grads = self._take_grads()
            gnorm = self.grad_norm(grads)  # the fp32 norm of all of them
        else:
            gnorm = torch.linalg.vector_norm(self._grad(), dtype=torch.float32) / self.world
        skip = (~torch.isfinite(gnorm)).float()
        # Clipping multiplies by clip / (norm + 1e-6) when that is < 1, as clip_grad_norm_ does.
        divisor = (gnorm + 1e-6).div(clip).clamp(min=1.0) * self.world if clip > 0 else gnorm.new_full((), self.world)
        if load_lr:
            self.load_lr()
        self.step.add_(1 - skip)
        side = self._stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        # No torch.cuda call without a side stream: on a CPU rank of a CUDA machine it would create a
        # CUDA context (and fail in a forked process).
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for i, (_, bufs) in enumerate(self._segments):
                if self.direct:
                    ids = self._seg_ids[i]
                    seg = grads[ids.start:ids.stop]
                    bufs = [bufs[0], seg, *bufs[2:]]
                    if side is not None:
                        self._held[i] = seg
                self._update(*bufs, self.step, self._lr, divisor, skip, **self.hyper)
                if side is not None:
                    self._pending[i] = side.record_event()
            if not self.write_grads:  # after the updates that read it, on their stream
                self.grad.zero_()
                if side is not None:
                    self._pending[-1] = side.record_event()
        if side is not None:
            for t in (divisor, skip):  # freed here, still read there: keep their memory until it is done
                t.record_stream(side)
        if self.write_grads:
            self._fresh = True  # the next backward's gradients overwrite this one's
        return gnorm, skip

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master weights, flat: the buffer, or (split) joined from its halves into a new tensor."""
        self.wait_all()
        return master_of(self.work, self._master) if self.split else self._master

    def named_master(self) -> Mapping[str, torch.Tensor]:
        """The fp32 master weights by parameter name: views of the buffer, or (split) each joined from
        its halves when read, so that a reader going through them (a checkpoint's host copy, the
        export) holds one parameter's fp32 copy at a time, not the whole master's."""
        self.wait_all()
        if self.split:
            return _JoinedMaster(dict(zip(self.names, zip(self._views(self.work), self._views(self._master)))))
        return dict(zip(self.names, self._views(self._master)))

    def state_dict(self) -> dict:
        self.wait_all()
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": self.step}

    def load_state_dict(self, master: dict[str, torch.Tensor], state: dict) -> None:
        """Master weights by name plus `state_dict()`'s moments; the working copy follows."""
        missing = [k for k in self.names if k not in master]
        if missing or "exp_avg" not in state:
            raise ValueError(f"checkpoint lacks {missing[:3] or ['optimizer moments']}: it was written by another "
                             "version of the trainer or for another drafter; start fresh (checkpoint.resume='') "
                             "or resume with the version that wrote it")
        self.wait_all()
        with torch.no_grad():
            for p, name in zip(self.params, self.names):
                if master[name].shape != p.shape:
                    raise ValueError(f"checkpoint tensor {name} has shape {tuple(master[name].shape)}, the "
                                     f"drafter {tuple(p.shape)}: the drafter config differs from the run's; "
                                     "resume with the drafter.* settings of the run that wrote it")
            self._write_master([master[name] for name in self.names])
            for k in ("exp_avg", "exp_avg_sq", "step"):
                getattr(self, k).copy_(state[k])

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers this optimizer holds, plus the gradients where autograd leaves them
        (direct: the `.grad` tensors present now; flat: its buffer)."""
        out = [self._master, self.exp_avg, self.exp_avg_sq]
        out += [self.work] if self.work is not self._master else []
        out += [self._reduce] if self._reduce is not None else []
        out += [p.grad for p in self.params if p.grad is not None] if self.direct else [self.grad]
        return sum(t.nbytes for t in out)

    @property
    def num_bytes_per_step(self) -> float:
        """Bytes one update moves (reads + writes), for bandwidth figures."""
        grad = self.work.element_size() if self.direct else self._grad().element_size()  # direct: the params' dtype
        if self.split:  # the two halves read and written, no separate working copy
            return self.work.numel() * (4 * 2 * 2 + grad + 2 * 2 * 2)
        work = self.work.element_size() if self.work is not self._master else 0
        return self._master.numel() * (4 * 3 * 2 + grad + work)
