"""The split planner's rate model: FLOPs per sample on each side, the layouts of target and drafter
GPUs and their predicted throughput, and the `topology.num_target_ranks=auto` choice.

A "sample" is one packed batch of `data.seq_len` tokens: a target rank produces samples, a drafter
rank consumes one per step. A split of `W` GPUs into `n` target and `W - n` drafter GPUs delivers
`min(n * t, (W - n) * d)` samples/s; one GPU shared by a target and a drafter process can close the
gap, up to the fluid bound `W*t*d/(t+d)`. With `target.stages=S > 1` a replica spans S GPUs and
delivers about `S * t * balance` samples/s (`stages.plan_stages`).

Pure numbers in, numbers out, below the start-up (`runtime`) that feeds it the job's resolved target
(its config, captured layers and mask token, derived once there); the command-line report is
`dflash_mp.plan`, on top.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .flops import (DrafterShape, causal_pairs_packed, drafter_attention_flops, drafter_matmul_flops,
                    target_layers_flops)
from .gpu_memory import GIB
from .stages import plan_stages
from .trainer import build_drafter_args

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- FLOP model
@dataclass(frozen=True)
class Workload:
    """FLOPs of one sample (packed batch) on each side."""

    target_flops: float  # truncated target forward
    drafter_flops: float  # drafter forward + backward + optimizer-free step

    def rates(self, peak_tflops: float, target_mfu: float, drafter_mfu: float) -> tuple[float, float]:
        """(target, drafter) samples/s per GPU at the assumed MFUs."""
        peak = peak_tflops * 1e12
        return peak * target_mfu / self.target_flops, peak * drafter_mfu / self.drafter_flops


def workload(target_config: dict, layer_ids: list[int], shape: DrafterShape, seq_len: int, num_anchors: int,
             block_size: int, doc_len: int = 1024) -> Workload:
    """FLOPs per packed batch of `seq_len` tokens made of documents of `doc_len` tokens."""
    doc_len = max(1, min(doc_len, seq_len))
    docs = [doc_len] * (seq_len // doc_len) + ([seq_len % doc_len] if seq_len % doc_len else [])
    t = target_layers_flops(target_config, range(max(layer_ids) + 1), seq_len, causal_pairs_packed(docs))
    # A block sees on average half a document of context plus its own B x B block, in every layer.
    visible = shape.num_layers * num_anchors * (doc_len / 2 * block_size + block_size * block_size)
    d = drafter_matmul_flops(shape, seq_len, num_anchors, block_size) + drafter_attention_flops(shape, visible)
    return Workload(t, d)


# --------------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    target_gpus: int  # GPUs running only the target
    drafter_gpus: int  # GPUs running only the drafter
    shared_gpus: int  # GPUs running one target and one drafter process (0, 1, or every GPU)
    target_share: float  # fraction of the shared GPU's time the target gets (0 when none is shared)
    samples_per_s: float  # predicted pipeline throughput: min(produced, consumed)
    stages: int = 1  # GPUs per target replica (target.stages); target_gpus is a multiple of it

    @property
    def num_processes(self) -> int:
        return self.target_gpus + self.drafter_gpus + 2 * self.shared_gpus

    @property
    def num_target_ranks(self) -> int:
        return self.target_gpus + self.shared_gpus

    @property
    def num_replicas(self) -> int:
        return self.target_gpus // self.stages

    def describe(self) -> str:
        if self.stages > 1:
            n = self.num_replicas
            return (f"{n} target replica{'s' if n > 1 else ''} x {self.stages} stages ({self.target_gpus} GPUs) "
                    f"+ {self.drafter_gpus} drafter GPUs")
        if self.shared_gpus and not (self.target_gpus or self.drafter_gpus):
            gpus = "1 GPU" if self.shared_gpus == 1 else f"{self.shared_gpus} GPUs each"
            return f"{gpus} shared by a target and a drafter ({self.target_share:.0%} target)"
        s = f"{self.target_gpus} target + {self.drafter_gpus} drafter GPUs"
        if self.shared_gpus:
            s += f" + 1 shared ({self.target_share:.0%} target)"
        return s


def whole_splits(world: int, t: float, d: float, stages: int = 1, balance: float = 1.0) -> list[Layout]:
    """Every split of `world` GPUs into n >= 1 target and world - n >= 1 drafter GPUs, n a multiple of
    `stages`: n / stages replicas, each delivering stages * t * balance samples/s."""
    return [Layout(n, world - n, 0, 0.0, min(n * t * balance, (world - n) * d), stages)
            for n in range(stages, world, stages)]


def _staged_whole_splits(world: int, t: float, d: float, stages: int, balance: float) -> list[Layout]:
    """`whole_splits`, refusing a world with no room for one replica plus a drafter."""
    if stages < 1:
        raise ValueError(f"target.stages={stages}: use 1 (the whole target on one GPU) or more.")
    if not 0.0 < balance <= 1.0:
        raise ValueError(f"stage balance {balance} must be in (0, 1] (mean over largest stage cost).")
    layouts = whole_splits(world, t, d, stages, balance)
    if not layouts:
        raise ValueError(
            f"world_size={world} has no room for one target replica of target.stages={stages} GPUs plus a "
            f"drafter GPU: use at least {stages + 1} GPUs, or fewer target.stages.")
    return layouts


def shared_splits(world: int, t: float, d: float, efficiency: float = 0.9) -> list[Layout]:
    """Splits with one GPU shared by a target and a drafter process.

    The shared GPU gives a fraction f of its time to the target and 1 - f to the drafter, and delivers
    `efficiency` of a dedicated GPU's throughput overall (two processes contend for memory and SMs).
    Drafters step in lock-step (one gradient all-reduce per step), so every drafter runs at the pace
    of the one on the shared GPU: consumption is (nd + 1) * e * (1 - f) * d, not nd * d plus a share
    (on 2 H200s, 1 target + 2 drafters, one sharing the target's GPU, ran slower than 1 + 1 whole GPUs;
    BENCHMARKS.md, issue 24). f balances nt*t + e*f*t = (nd + 1)*e*(1 - f)*d.
    """
    out = []
    for nt in range(world):
        nd = world - 1 - nt
        f = ((nd + 1) * efficiency * d - nt * t) / (efficiency * t + (nd + 1) * efficiency * d)
        f = min(1.0, max(0.0, f))
        rate = min(nt * t + efficiency * f * t, (nd + 1) * efficiency * (1 - f) * d)
        if 0.0 < f < 1.0:  # at 0 or 1 one role gets nothing: a whole split describes it better
            out.append(Layout(nt, nd, 1, f, rate))
    return out


def all_shared(world: int, t: float, d: float, efficiency: float = 0.9) -> Layout:
    """Every GPU runs one target and one drafter process (torchrun --nproc-per-node 2*world,
    num_target_ranks=world: target i feeds drafter world+i on GPU i over the shm ring). Each GPU
    alternates the two roles: e * t*d/(t+d) per GPU, the fluid bound less contention."""
    return Layout(0, 0, world, d / (t + d), efficiency * fluid_bound(world, t, d))


def plan_layouts(world: int, t: float, d: float, efficiency: float = 0.9, stages: int = 1,
                 balance: float = 1.0, turns_efficiency: float = 1.0) -> list[Layout]:
    """All layouts considered, best first (ties: whole-GPU layouts, then fewer target GPUs). With
    `stages` > 1 only whole splits into replicas of `stages` GPUs (no GPU is shared). One GPU has one
    layout: a target and a drafter process sharing it, taking turns at it (`topology.gpu_turns=auto`),
    which keeps `turns_efficiency` of the fluid bound instead of `efficiency`."""
    if world < 1:
        raise ValueError(f"world_size={world}: plan for 1 GPU or more.")
    if t <= 0 or d <= 0:
        raise ValueError(f"rates must be positive, got target {t}, drafter {d} samples/s per GPU.")
    if world == 1 and stages == 1:
        return [all_shared(1, t, d, turns_efficiency)]
    if stages != 1:
        layouts = _staged_whole_splits(world, t, d, stages, balance)
    else:
        layouts = (whole_splits(world, t, d) + shared_splits(world, t, d, efficiency)
                   + [all_shared(world, t, d, efficiency)])
    return sorted(layouts, key=lambda lay: (-round(lay.samples_per_s, 9), lay.shared_gpus, lay.target_gpus))


def best_whole(layouts: list[Layout]) -> Layout:
    """The best of whole-GPU `layouts`: the most samples/s, then the fewest target GPUs."""
    return max(layouts, key=lambda lay: (round(lay.samples_per_s, 9), -lay.target_gpus))


def best_whole_split(world: int, t: float, d: float, stages: int = 1, balance: float = 1.0) -> int:
    """num_target_ranks of the best whole-GPU split (what `topology.num_target_ranks=auto` picks): a
    multiple of `stages`."""
    return best_whole(_staged_whole_splits(world, t, d, stages, balance)).target_gpus


def fluid_bound(world: int, t: float, d: float) -> float:
    """Throughput if GPU time could be split freely between the roles."""
    return world * t * d / (t + d)


# ------------------------------------------------------------------------------------ memory floor

@dataclass(frozen=True)
class MemoryFloor:
    """Bytes a process holds before its first step: a floor under what it needs. A target rank holds
    its stage's weights; a drafter rank its trainable weights with their training state (master,
    gradients, AdamW moments: `optim.held_bytes_per_param`) and the target's frozen embedding and LM
    head. Activations, compiled graphs, the CUDA context and the allocator's cache come on top, so a
    GPU over the floor cannot run its processes, and one under it may still not.

    `target_step` and `drafter_step`: what one forward or training step adds on top
    (`target_step_bytes`, `drafter_step_bytes`): an estimate, not a floor (0: not estimated)."""

    target: int  # one target rank: the largest stage's weights
    drafter: int  # the only drafter rank
    drafter_dp: int  # one of 2+ drafter ranks (the gradients' data-parallel sum adds a buffer)
    target_step: int = 0
    drafter_step: int = 0

    def _roles(self, layout: Layout, step: bool) -> tuple[int, int]:
        """(a target rank, a drafter rank) of `layout`: the floor, or with `step` the estimate."""
        drafter = self.drafter_dp if layout.drafter_gpus + layout.shared_gpus > 1 else self.drafter
        if step:
            return self.target + self.target_step, drafter + self.drafter_step
        return self.target, drafter

    def per_gpu(self, layout: Layout, step: bool = False) -> int:
        """The most any GPU of `layout` holds (with `step`: the estimate with one step's activations)."""
        target, drafter = self._roles(layout, step)
        return max(target if layout.target_gpus else 0, drafter if layout.drafter_gpus else 0,
                   target + drafter if layout.shared_gpus else 0)

    def misfit(self, layout: Layout, gpu_bytes: float, step: bool = False) -> str | None:
        """Why `layout` cannot run on GPUs of `gpu_bytes` (None: its floor fits). With `step`, why it
        would run out of memory by the estimate with one step's activations (None: the estimate fits)."""
        need = self.per_gpu(layout, step)
        if need <= gpu_bytes:
            return None
        target, drafter = self._roles(layout, step)
        if layout.shared_gpus and target + drafter == need:
            who = "a GPU holding a target and a drafter"
        elif target == need:
            who = "a target rank"
        else:
            who = "a drafter rank"
        if step:
            return (f"{who} needs ~{need / GIB:.1f} GiB with one step's activations (estimated), "
                    f"the GPU {gpu_bytes / GIB:.1f}")
        return f"{who} holds >= {need / GIB:.1f} GiB, the GPU {gpu_bytes / GIB:.1f}"


def drafter_step_bytes(s: DrafterShape, seq_len: int, num_anchors: int, block_size: int, chunk_rows: int,
                       itemsize: int = 2) -> int:
    """What one drafter training step holds on top of its weights and training state, estimated from
    its shapes (activations of `itemsize` bytes) as the compiled layers save them for the backward:
    per layer and block row (A*B of them), the layer's input and its sum with the attention's output,
    each also normalised (4 x hidden), the queries before and after RoPE and the attention's output
    (3 x q), the MLP's gate, up and their product (3 x intermediate); per layer and context or block
    row, the keys before and after RoPE and the values (3 x kv). On top: the received target states,
    the fused context before and after its norm, the fused CE's chunk of logits (`chunk_rows` x vocab,
    its gradient written in place) and the gradient it hands the predicted rows. The first and last
    layers, which run fewer rows, are counted as the others: an estimate from above for them."""
    rows = num_anchors * block_size
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    layer = rows * (4 * s.hidden + 3 * q + 3 * s.intermediate) + (rows + seq_len) * 3 * kv
    context = seq_len * (s.num_target_layers + 2) * s.hidden
    predicted = num_anchors * (block_size - 1)
    ce = min(chunk_rows, predicted) * s.vocab + predicted * s.hidden
    return itemsize * (s.num_layers * layer + context + ce)


def target_step_bytes(spec, seq_len: int, num_captured: int, depth: int, itemsize: int = 2) -> int:
    """What one target forward holds on top of the weights, estimated from its shapes (`spec`, its
    TargetSpec; a mixture of experts counts the experts each token visits): the residual stream and a
    layer's largest transients (its input norm, q/k/v, the MLP's gate, up and product), and the captured
    states, the batch being filled plus `depth` in flight to the drafter."""
    h = spec.hidden_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layer = seq_len * (2 * h + q + 2 * kv + 3 * spec.token_mlp_width)
    return itemsize * (layer + (1 + depth) * seq_len * num_captured * h)


# ------------------------------------------------------------------------------- from a job config
# MFUs of the two roles when nothing is measured: what the Qwen3-8B shapes reach on an H200 at the
# defaults (the target forward 0.78-0.795 as a CUDA graph; the drafter step 0.752-0.757 since its first
# and last layers skip the rows nothing reads, call D3 of BENCHMARKS.md).
TARGET_MFU, DRAFTER_MFU = 0.78, 0.75


def job_workload(job, target_config: dict, spec, layer_ids: list[int], mask_token_id: int,
                 doc_len: int = 1024) -> Workload:
    """The job's FLOPs per sample, given its target as the start-up resolved it (`spec`: the
    TargetSpec parsed from `target_config`)."""
    a = build_drafter_args(job.drafter, spec, layer_ids, mask_token_id)
    return workload(target_config, layer_ids, DrafterShape.from_args(a), job.data.seq_len, job.drafter.num_anchors,
                    a.block_size, doc_len)


def stage_balance(job, target_config: dict, layer_ids: list[int], doc_len: int = 1024) -> float:
    """Mean over largest stage cost of the job's target split (`stages.plan_stages`); 1.0 unstaged."""
    if job.target.stages == 1:
        return 1.0
    return plan_stages(target_config, layer_ids, job.target.stages, job.data.seq_len, doc_len).balance()


def resolve_num_target_ranks(job, world_size: int, target_config: dict, spec, layer_ids: list[int],
                             mask_token_id: int) -> int:
    """`topology.num_target_ranks`, with "auto" replaced by the best whole-GPU split's target count
    (a multiple of `target.stages`: whole replicas)."""
    n = job.topology.num_target_ranks
    if n != "auto":
        if isinstance(n, str):
            raise ValueError(f"topology.num_target_ranks={n!r}: use an integer or 'auto'.")
        return n
    if world_size < 2:
        return 1  # Topology.plan raises with the fix
    t, d = job_workload(job, target_config, spec, layer_ids, mask_token_id).rates(job.logging.peak_tflops,
                                                                                    TARGET_MFU, DRAFTER_MFU)
    stages = job.target.stages
    if stages == 1:
        n = best_whole_split(world_size, t, d)
        log.info("topology.num_target_ranks=auto -> %d (estimated %.3g target, %.3g drafter samples/s per GPU)",
                 n, t, d)
        return n
    balance = stage_balance(job, target_config, layer_ids)
    n = best_whole_split(world_size, t, d, stages, balance)
    log.info("topology.num_target_ranks=auto -> %d = %d replica(s) x %d stages (estimated %.3g samples/s per "
             "replica at stage balance %.2f, %.3g drafter samples/s per GPU)",
             n, n // stages, stages, stages * t * balance, balance, d)
    return n
