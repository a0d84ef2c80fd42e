"""Split planner: how many GPUs should run the target, and how many the drafter?

    python -m dflash_mp.plan experiment=qwen3_8b plan.world_size=8 [data.seq_len=3072]
        [plan.peak_tflops=790] [plan.target_mfu=0.6 plan.drafter_mfu=0.5] [plan.measure=true]
        [plan.gpu_memory_gib=79.2]

A "sample" is one packed batch of `data.seq_len` tokens: a target rank produces samples, a drafter
rank consumes one per step. Per-GPU rates come from the model FLOPs of `dflash_mp.flops` against
`peak_tflops * mfu` (or, with `plan.measure=true`, from timing both on the local accelerator). A split of
`W` GPUs into `n` target and `W - n` drafter GPUs delivers `min(n * t, (W - n) * d)` samples/s.
When the rates do not divide evenly, one GPU shared by a target and a drafter process (over the shm
ring; its throughput split between them) can close the gap, up to the fluid bound `W*t*d/(t+d)`.
One GPU (`plan.world_size=1`) has one layout: a target and a drafter process sharing it, taking turns.
With `target.stages=S > 1` a target replica spans S GPUs and delivers about `S * t * balance`
samples/s (`t` the one-GPU rate of the whole truncated target, `balance` the stage plan's mean/max
stage cost, `stages.plan_stages`): only whole splits into replicas of S GPUs are considered.

Each layout is checked against one GPU's memory (`plan.gpu_memory_gib`, else this machine's GPU):
what its processes hold before their first step (`split.MemoryFloor`: a target rank's weights, a
drafter rank's weights with their master, gradients and AdamW moments and the target's embedding and
LM head, counted on the meta device) must fit each GPU; a layout over it is marked and never
recommended. So is one whose estimate with one step's activations (`split.drafter_step_bytes`,
`split.target_step_bytes`, from the shapes) does not fit. The estimate leaves out compiled graphs, the
CUDA context and the allocator's cache: the 8B job's ranks on one H100 peaked at 0.99 (drafter) and 1.03
(target) of it, reserved, once each gave back what its build left cached; the 27B drafter's step alone
held 0.93 of it over its captured steps and peaked at 0.98 in the launched steps before the capture
(BENCHMARKS.md, call Q14). A layout just under it may still
run out of memory, and the job's error then names the fix.

The rate model, the layouts and the floor's arithmetic are `dflash_mp.split` (below the start-up, which
asks it for `num_target_ranks=auto`); this module is the command on top: it reads the job, derives the
target's captured layers and mask token as a run does (`runtime.validate`), and prints the report.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from .archs import TARGET_ARCHS, hf_config, known_target_config
from .batch import HiddenBatch, PackedBatch
from .cli import entry, tool_main
from .flops import DrafterShape
from .model import DFlashDrafter
from .optim import held_bytes_per_param
from .runtime import pick_device, resolve, validate
from .split import (DRAFTER_MFU, GIB, TARGET_MFU, Layout, MemoryFloor, best_whole, drafter_step_bytes,
                    fluid_bound, job_workload, plan_layouts, target_step_bytes)
from .stages import plan_stages
from .target import TargetSpec, TargetWorker, load_target_config, resolve_dtype, truncate
from .target.weights import stage_weight_bytes
from .trainer import DFlashObjective, DrafterTrainer, build_drafter_args, resolve_precision

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- from a job config
def planned_ids(job, target_config: dict, spec: TargetSpec | None = None) -> tuple[list[int], int]:
    """(layer_ids, mask_token_id) as a run of `job` derives them (`runtime.validate`, the one
    derivation), with the tokenizer's length from the table for known hub ids: the planner runs
    before any weights or tokenizer are downloaded."""
    arch = TARGET_ARCHS.get(job.target.path)
    if arch is not None:
        tokenizer_len = arch["tokenizer_len"]
    else:
        from transformers import AutoTokenizer  # seconds to import: only for targets outside the table

        tokenizer_len = len(AutoTokenizer.from_pretrained(job.target.path))
    return validate(job, target_config, range(tokenizer_len), spec)


def target_config_for(job) -> dict:
    """The target's config.json fields of a resolved job (runtime.resolve): from the table for known
    hub ids, else read (no weights)."""
    return known_target_config(job.target.path) or load_target_config(job.target.path)


def memory_floor(job, target_config: dict, spec: TargetSpec, layer_ids: list[int], mask_token_id: int,
                 bounds: list[tuple[int, int]]) -> MemoryFloor:
    """What the job's processes hold on GPUs before their first step (`split.MemoryFloor`), its dtypes
    resolved as on CUDA. `bounds`: the target's stages, [first, end) each. The target's stages and the
    drafter are built on the meta device, which allocates nothing: exact for every architecture
    transformers builds. The table's dense targets carry no model type and are counted as Qwen3's
    modules (a Llama layer of the same shapes holds the same weights but the q/k norms' 256)."""
    cuda = torch.device("cuda")
    dtype = resolve_dtype(job.target.dtype, cuda)
    config = hf_config({"model_type": "qwen3", **target_config})
    last = max(layer_ids)
    target = max(stage_weight_bytes(config, first, end, end == last + 1, dtype) for first, end in bounds)
    with torch.device("meta"):
        drafter = DFlashDrafter(build_drafter_args(job.drafter, spec, layer_ids, mask_token_id))
    n = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    work = torch.bfloat16 if resolve_precision(job.train.precision, cuda) == "bf16" else torch.float32
    # The target's embedding and LM head the drafter reads (frozen): one tensor where they are tied.
    frozen = (1 if spec.tied_embeddings else 2) * spec.vocab_size * spec.hidden_size * dtype.itemsize
    # One step's working memory on top, estimated from the shapes (split.{target,drafter}_step_bytes).
    a = drafter.args
    drafter_step = drafter_step_bytes(DrafterShape.from_args(a), job.data.seq_len, job.drafter.num_anchors,
                                      a.block_size, job.drafter.loss_chunk_size, work.itemsize)
    target_step = target_step_bytes(spec, job.data.seq_len, len(layer_ids), job.transport.depth,
                                    dtype.itemsize)
    return MemoryFloor(target, n * held_bytes_per_param(work) + frozen,
                       n * held_bytes_per_param(work, replicas=2) + frozen, target_step, drafter_step)


def gpu_memory(gib: float | None) -> tuple[float | None, str]:
    """(bytes of one GPU's memory, where the figure comes from): `plan.gpu_memory_gib`, else this
    machine's first GPU, else (None, "")."""
    if gib is not None:
        if gib <= 0:
            raise ValueError(f"plan.gpu_memory_gib={gib:g}: give a GPU's memory in GiB (80 GB cards: 79.2), "
                             "or null for this machine's GPU.")
        return gib * GIB, f"plan.gpu_memory_gib={gib:g}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"this machine's {props.name}"
    return None, ""


# --------------------------------------------------------------------------------------- measure
def measure_rates(job, target_config: dict, iters: int = 5, ids: tuple[list[int], int] | None = None
                  ) -> tuple[float, float]:
    """(target, drafter) samples/s on the local accelerator (CPU when there is none), random weights.
    `ids`: (layer_ids, mask_token_id) when the caller derived them already."""
    dev = pick_device()  # the GPU a run's process of this local rank would take, made current
    dtype = resolve_dtype(job.target.dtype, dev)
    tc = target_config
    layer_ids, mask = ids or planned_ids(job, tc)
    T = job.data.seq_len
    g = torch.Generator().manual_seed(0)
    doc = min(1024, T)
    pos = torch.arange(T) % doc
    docs = torch.arange(T) // doc
    ids = torch.randint(0, tc["vocab_size"] - 1, (T,), generator=g)
    loss = (pos >= doc // 4).long()
    pb = PackedBatch(ids, pos, docs, loss, int(docs.max()) + 1, T)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def rate(fn) -> float:
        fn(), fn()  # warm-up (compile, autotune, allocator)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return iters / (time.perf_counter() - t0)

    from transformers import AutoConfig, AutoModelForCausalLM

    def time_target() -> tuple[float, HiddenBatch]:
        # A Qwen3-architecture stand-in with the target's shapes (the FLOPs of a Llama layer are the
        # same), built only up to the last captured layer; freed on return, before the drafter.
        cfg = AutoConfig.for_model(**{"model_type": "qwen3", **tc})
        cfg.num_hidden_layers = max(layer_ids) + 1
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=dtype, attn_implementation="flex_attention" if dev.type == "cuda" else "sdpa")
        truncate(model, max(layer_ids))
        worker = TargetWorker(model.eval().requires_grad_(False), layer_ids, dev,
                              compile=job.target.compile and dev.type == "cuda")
        return rate(lambda: worker.forward(pb)), worker.forward(pb).to(dev, copy=True)

    t_rate, hb = time_target()

    args = build_drafter_args(job.drafter, tc, layer_ids, mask)
    with torch.device(dev):
        drafter = DFlashDrafter(args)
        embed = torch.randn(tc["vocab_size"], tc["hidden_size"], dtype=dtype) * 0.02
    objective = DFlashObjective(drafter, args, embed, embed, job.drafter)
    trainer = DrafterTrainer(objective, job.train, 1000, None, dev)
    d_rate = rate(lambda: trainer.train_step(hb))
    return t_rate, d_rate


# ------------------------------------------------------------------------------------------- CLI
@dataclass
class PlanConfig:
    world_size: int = 8  # GPUs to split between target and drafter ranks
    peak_tflops: Optional[float] = None  # per-GPU dense bf16 rate; null = logging.peak_tflops
    target_mfu: float = TARGET_MFU  # fraction of peak the target's forward reaches
    drafter_mfu: float = DRAFTER_MFU  # fraction of peak the drafter's train step reaches
    doc_len: int = 1024  # mean document length, for the attention FLOPs of packed batches
    shared_efficiency: float = 0.9  # throughput kept by a GPU shared by a target and a drafter
    # ... on one GPU, where the job's only target and drafter take turns at it (topology.gpu_turns=auto):
    # 0.997-1.007 of what the two parts allow alone, measured for the 8B job on one H200 (BENCHMARKS.md)
    turns_efficiency: float = 1.0
    measure: bool = False  # time both on the local accelerator instead of estimating from FLOPs
    # One GPU's memory (GiB) the layouts are checked against; null: this machine's GPU, if it has one.
    gpu_memory_gib: Optional[float] = None


# What the report cannot promise where it knows no GPU's memory.
MEMORY_CAVEAT = ("memory is not checked: no GPU's memory is known here (set plan.gpu_memory_gib); processes "
                 "that do not fit a GPU stop with an out-of-memory error naming the fix")


def format_report(world: int, t: float, d: float, layouts: list[Layout], seq_len: int, stages: int = 1,
                  balance: float = 1.0, floor: MemoryFloor | None = None, gpu: float | None = None,
                  gpu_from: str = "") -> str:
    """The report: rates, layouts best first (with `floor` and `gpu`, bytes of one GPU's memory, those
    whose floor does not fit, or whose estimate with one step's activations does not, are marked and
    never recommended), the launch, and the memory floor and estimate."""
    checked = floor is not None and gpu is not None
    over = [floor.misfit(lay, gpu) if checked else None for lay in layouts]  # the floor does not fit
    likely = [floor.misfit(lay, gpu, step=True) if checked and why is None else None  # the estimate does not
              for lay, why in zip(layouts, over)]
    misfits = [f"does not fit: {o}" if o else f"likely out of memory: {k}" if k else None
               for o, k in zip(over, likely)]
    lines = _layouts_lines(world, t, d, layouts, misfits, seq_len, stages, balance)
    if floor is not None:
        stage = " (its largest stage)" if stages > 1 else ""
        lines.append(f"memory floor before the first step: a target rank {floor.target / GIB:.1f} GiB"
                     f"{stage}, a drafter rank {floor.drafter / GIB:.1f} GiB "
                     f"({floor.drafter_dp / GIB:.1f} as one of several): weights, a drafter's master, "
                     "gradients and AdamW moments, and the target's embedding and LM head")
        step = floor.drafter_step
        lines.append(f"with one step's activations (estimated from the shapes): a target rank "
                     f"~{(floor.target + floor.target_step) / GIB:.1f} GiB, a drafter rank "
                     f"~{(floor.drafter + step) / GIB:.1f} GiB ({(floor.drafter_dp + step) / GIB:.1f}); "
                     "compiled graphs, the CUDA context and the allocator's cache come on top")
    if not checked:
        return "\n".join(lines + [MEMORY_CAVEAT])
    n_over, n_likely = sum(o is not None for o in over), sum(k is not None for k in likely)
    lines.append(f"checked against {gpu / GIB:.1f} GiB a GPU ({gpu_from}): of {len(layouts)} layouts, "
                 f"{n_over} over the floor and {n_likely} over the estimate (marked); the others may still run "
                 "out of memory, the allocator's cache and compiled graphs coming on top")
    if n_over + n_likely == len(layouts):
        lines.append(_no_fit(floor, gpu, stages, world))
    return "\n".join(lines)


def _no_fit(floor: MemoryFloor, gpu: float, stages: int, world: int) -> str:
    """The fix when no layout fits GPUs of `gpu` bytes, by the floor or by the estimate with one step's
    activations (the floor named where it is over already)."""
    for step in (False, True):
        target = floor.target + (floor.target_step if step else 0)
        drafter = floor.drafter + (floor.drafter_step if step else 0)
        if target > gpu:
            held = (f" needs ~{target / GIB:.1f} GiB with one step's activations" if step
                    else f"'s weights alone hold {target / GIB:.1f} GiB")
            return (f"no layout fits: a target rank{held}: split the target over more GPUs with a larger "
                    f"target.stages (now {stages}; each stage holds only its layers), or use GPUs with more "
                    "memory")
        if drafter > gpu:
            held = (f"needs ~{drafter / GIB:.1f} GiB with one step's activations: lower "
                    "drafter.loss_chunk_size, drafter.num_anchors or data.seq_len, " if step
                    else f"holds {drafter / GIB:.1f} GiB before its first step: ")
            return (f"no layout fits: a drafter rank {held}use GPUs with more memory, or a smaller drafter "
                    "(drafter.num_layers)")
    both = floor.target + floor.drafter
    with_step = both + floor.target_step + floor.drafter_step
    together = f"{both / GIB:.1f}" if both > gpu else f"~{with_step / GIB:.1f}"
    gpus = f"{world} GPU{'s' if world > 1 else ''}"
    return (f"no layout fits on {gpus}: a target and a drafter rank need a GPU each (together {together} "
            "GiB): use 2 or more GPUs")


def _layouts_lines(world: int, t: float, d: float, layouts: list[Layout], misfits: list[str | None],
                   seq_len: int, stages: int, balance: float) -> list[str]:
    """`misfits`: per layout, why it does not fit a GPU or likely runs out of memory (None: it may fit)."""
    lines = [f"per GPU: target {t:.4g} samples/s, drafter {d:.4g} samples/s (1 sample = {seq_len} tokens)"]
    if world == 1:
        only, why = layouts[0], misfits[0]
        if why is not None:
            return lines + [f"one GPU: {only.describe()}  ({why})"]
        return lines + [
            f"one GPU: {only.samples_per_s:.4g} samples/s, {only.describe()}  <- the only layout",
            "launch: torchrun --nproc-per-node 2 -m dflash_mp.main ...  (target rank 0 and drafter rank 1 share "
            "the GPU over the shm ring and take turns at it: topology.gpu_turns=auto)"]
    fitting = [lay for lay, why in zip(layouts, misfits) if why is None]
    best = fitting[0] if fitting else None
    wholes = [lay for lay in fitting if not lay.shared_gpus]  # ranked as num_target_ranks=auto ranks them
    whole = best_whole(wholes).target_gpus if wholes else None
    if stages > 1:
        lines.append(f"per target replica of {stages} stages: {stages * t * balance:.4g} samples/s "
                     f"(stage balance {balance:.2f})")
    lines += [
        f"fluid bound for {world} GPUs: {fluid_bound(world, t * balance, d):.4g} samples/s",
        "layouts considered (predicted samples/s):",
    ]
    for lay, why in zip(layouts, misfits):
        mark = "  <- best" if lay is best else f"  ({why})" if why else ""
        lines.append(f"  {lay.samples_per_s:10.4g}  {lay.describe()}{mark}")
    if whole is None:
        return lines
    if stages > 1:
        lines.append(f"recommended whole-GPU split: topology.num_target_ranks={whole} target.stages={stages} "
                     f"({whole // stages} replica(s); torchrun --nproc-per-node {world})")
    else:
        lines.append(f"recommended whole-GPU split: topology.num_target_ranks={whole} "
                     f"(torchrun --nproc-per-node {world})")
    if best is None:
        return lines
    if best.shared_gpus > 1:
        lines.append(
            f"best overall shares every GPU: torchrun --nproc-per-node {best.num_processes} ... "
            f"topology.num_target_ranks={best.num_target_ranks}  (rank r runs on GPU r mod {world}: target "
            f"i and drafter {world}+i share GPU i over the shm ring; the role groups run on NCCL)")
    elif best.shared_gpus:
        lines.append(
            f"best overall shares one GPU: torchrun --nproc-per-node {best.num_processes} ... "
            f"topology.num_target_ranks={best.num_target_ranks}  (ranks beyond the GPU count wrap onto "
            "GPU 0, so the last rank, a drafter, shares GPU 0 with target rank 0 over the shm ring; "
            "groups whose members own distinct GPUs, the drafters' included, still run on NCCL)")
    return lines


def run_plan(job, opts: PlanConfig) -> None:
    gpu, gpu_from = gpu_memory(opts.gpu_memory_gib)
    job = resolve(job)  # builtin names -> real paths
    peak = job.logging.peak_tflops if opts.peak_tflops is None else opts.peak_tflops
    tcfg = target_config_for(job)
    spec = TargetSpec.from_config(tcfg)
    layer_ids, mask = planned_ids(job, tcfg, spec)
    if opts.measure:
        t, d = measure_rates(job, tcfg, ids=(layer_ids, mask))
        print("measured on the local device")
    else:
        t, d = job_workload(job, tcfg, spec, layer_ids, mask, opts.doc_len).rates(peak, opts.target_mfu, opts.drafter_mfu)
        print(f"estimated from FLOPs at {peak:g} TFLOP/s, MFU target {opts.target_mfu:g} / "
              f"drafter {opts.drafter_mfu:g}")
    world = opts.world_size
    stages = job.target.stages
    balance = 1.0
    if stages > 1:
        stage_plan = plan_stages(tcfg, layer_ids, stages, job.data.seq_len, opts.doc_len)
        balance = stage_plan.balance()
        print(f"target.stages={stages}: {stage_plan.describe()}")
    layouts = plan_layouts(world, t, d, opts.shared_efficiency, stages, balance, opts.turns_efficiency)
    bounds = list(stage_plan.bounds) if stages > 1 else [(0, max(layer_ids) + 1)]
    floor = memory_floor(job, tcfg, spec, layer_ids, mask, bounds)
    print(format_report(world, t, d, layouts, job.data.seq_len, stages, balance, floor, gpu, gpu_from))


def main(argv: list[str] | None = None) -> None:
    tool_main("plan", PlanConfig, run_plan, __doc__, argv)


if __name__ == "__main__":
    entry(main)
