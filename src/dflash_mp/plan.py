"""Split planner: how many GPUs should run the target, and how many the drafter?

    python -m dflash_mp.plan experiment=qwen3_8b plan.world_size=8 [data.seq_len=3072]
        [plan.peak_tflops=790] [plan.target_mfu=0.6 plan.drafter_mfu=0.5] [plan.measure=true]

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

The rate model and the layouts are `dflash_mp.split` (below the start-up, which asks it for
`num_target_ranks=auto`); this module is the command on top: it reads the job, derives the target's
captured layers and mask token as a run does (`runtime.validate`), and prints the report.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from .archs import TARGET_ARCHS, known_target_config
from .batch import HiddenBatch, PackedBatch
from .cli import entry, tool_main
from .model import DFlashDrafter
from .runtime import pick_device, resolve, validate
from .split import DRAFTER_MFU, TARGET_MFU, Layout, best_whole_split, fluid_bound, job_workload, plan_layouts
from .stages import plan_stages
from .target import TargetSpec, TargetWorker, load_target_config, resolve_dtype, truncate
from .trainer import DFlashObjective, DrafterTrainer, build_drafter_args

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


# What the report cannot promise: the layouts are ranked by FLOPs, not checked against a GPU's memory.
MEMORY_CAVEAT = ("memory is not estimated: processes that do not fit a GPU together stop with an out-of-memory "
                 "error naming the fix (e.g. the 27B preset's target and drafter need more than one 80 GB GPU)")


def format_report(world: int, t: float, d: float, layouts: list[Layout], seq_len: int, stages: int = 1,
                  balance: float = 1.0) -> str:
    return "\n".join(_layouts_lines(world, t, d, layouts, seq_len, stages, balance) + [MEMORY_CAVEAT])


def _layouts_lines(world: int, t: float, d: float, layouts: list[Layout], seq_len: int, stages: int,
                   balance: float) -> list[str]:
    best = layouts[0]
    lines = [f"per GPU: target {t:.4g} samples/s, drafter {d:.4g} samples/s (1 sample = {seq_len} tokens)"]
    if world == 1:
        return lines + [
            f"one GPU: {best.samples_per_s:.4g} samples/s, {best.describe()}  <- the only layout",
            "launch: torchrun --nproc-per-node 2 -m dflash_mp.main ...  (target rank 0 and drafter rank 1 share "
            "the GPU over the shm ring and take turns at it: topology.gpu_turns=auto)"]
    whole = best_whole_split(world, t, d, stages, balance)
    if stages > 1:
        lines.append(f"per target replica of {stages} stages: {stages * t * balance:.4g} samples/s "
                     f"(stage balance {balance:.2f})")
    lines += [
        f"fluid bound for {world} GPUs: {fluid_bound(world, t * balance, d):.4g} samples/s",
        "layouts considered (predicted samples/s):",
    ]
    for lay in layouts:
        mark = "  <- best" if lay is best else ""
        lines.append(f"  {lay.samples_per_s:10.4g}  {lay.describe()}{mark}")
    if stages > 1:
        lines.append(f"recommended whole-GPU split: topology.num_target_ranks={whole} target.stages={stages} "
                     f"({whole // stages} replica(s); torchrun --nproc-per-node {world})")
    else:
        lines.append(f"recommended whole-GPU split: topology.num_target_ranks={whole} "
                     f"(torchrun --nproc-per-node {world})")
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
    print(format_report(world, t, d, layouts, job.data.seq_len, stages, balance))


def main(argv: list[str] | None = None) -> None:
    tool_main("plan", PlanConfig, run_plan, __doc__, argv)


if __name__ == "__main__":
    entry(main)
