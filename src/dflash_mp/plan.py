"""Split planner: how many GPUs should run the target, and how many the drafter?

    python -m dflash_mp.plan experiment=qwen3_8b plan.world_size=8 [data.seq_len=3072]
        [plan.peak_tflops=790] [plan.target_mfu=0.6 plan.drafter_mfu=0.5] [plan.measure=true]

A "sample" is one packed batch of `data.seq_len` tokens: a target rank produces samples, a drafter
rank consumes one per step. Per-GPU rates come from the model FLOPs of `dflash_mp.flops` against
`peak_tflops * mfu` (or, with `plan.measure=true`, from timing both on the local accelerator). A split of
`W` GPUs into `n` target and `W - n` drafter GPUs delivers `min(n * t, (W - n) * d)` samples/s.
When the rates do not divide evenly, one GPU shared by a target and a drafter process (over the shm
ring; its throughput split between them) can close the gap, up to the fluid bound `W*t*d/(t+d)`.
With `target.stages=S > 1` a target replica spans S GPUs and delivers about `S * t * balance`
samples/s (`t` the one-GPU rate of the whole truncated target, `balance` the stage plan's mean/max
stage cost, `stages.plan_stages`): only whole splits into replicas of S GPUs are considered.

Everything above the command line (`run_plan`, `main`) is pure: numbers in, numbers out.
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
from .flops import (DrafterShape, causal_pairs_packed, drafter_attention_flops, drafter_matmul_flops,
                    target_layers_flops)
from .model import DFlashDrafter
from .runtime import resolve
from .stages import plan_stages
from .target import (TargetSpec, TargetWorker, capture_layer_ids, load_target_config, mask_token_id, resolve_dtype,
                     truncate)
from .trainer import DFlashObjective, DrafterTrainer, build_drafter_args

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
            return f"{self.shared_gpus} GPUs each shared by a target and a drafter ({self.target_share:.0%} target)"
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
    (measured on 2 H200s: 1 target + 2 drafters, one sharing the target's GPU, ran at 6.83 samples/s,
    below the 8.01 of 1 + 1 whole GPUs). f balances nt*t + e*f*t = (nd + 1)*e*(1 - f)*d.
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
                 balance: float = 1.0) -> list[Layout]:
    """All layouts considered, best first (ties: whole-GPU layouts, then fewer target GPUs). With
    `stages` > 1 only whole splits into replicas of `stages` GPUs (no GPU is shared)."""
    if world < 2:
        raise ValueError(f"world_size={world}: a split needs at least 2 GPUs; plan for 2 or more.")
    if t <= 0 or d <= 0:
        raise ValueError(f"rates must be positive, got target {t}, drafter {d} samples/s per GPU.")
    if stages != 1:
        layouts = _staged_whole_splits(world, t, d, stages, balance)
    else:
        layouts = (whole_splits(world, t, d) + shared_splits(world, t, d, efficiency)
                   + [all_shared(world, t, d, efficiency)])
    return sorted(layouts, key=lambda lay: (-round(lay.samples_per_s, 9), lay.shared_gpus, lay.target_gpus))


def best_whole_split(world: int, t: float, d: float, stages: int = 1, balance: float = 1.0) -> int:
    """num_target_ranks of the best whole-GPU split (what `topology.num_target_ranks=auto` picks): a
    multiple of `stages`."""
    layouts = _staged_whole_splits(world, t, d, stages, balance)
    return max(layouts, key=lambda lay: (round(lay.samples_per_s, 9), -lay.target_gpus)).target_gpus


def fluid_bound(world: int, t: float, d: float) -> float:
    """Throughput if GPU time could be split freely between the roles."""
    return world * t * d / (t + d)


# ------------------------------------------------------------------------------- from a job config
def planned_ids(job, target_config: dict) -> tuple[list[int], int]:
    """(layer_ids, mask_token_id) as a run of `job` derives them (target.capture_layer_ids,
    target.mask_token_id), with the tokenizer's length from the table for known hub ids."""
    spec = TargetSpec.from_config(target_config)
    arch = TARGET_ARCHS.get(job.target.path)
    if arch is not None:
        tokenizer_len = arch["tokenizer_len"]
    else:
        from transformers import AutoTokenizer  # seconds to import: only for targets outside the table

        tokenizer_len = len(AutoTokenizer.from_pretrained(job.target.path))
    return (capture_layer_ids(job.target, spec.num_layers),
            mask_token_id(job.drafter.mask_token_id, tokenizer_len, spec.vocab_size))


def job_workload(job, target_config: dict, doc_len: int = 1024) -> Workload:
    layer_ids, mask = planned_ids(job, target_config)
    a = build_drafter_args(job.drafter, target_config, layer_ids, mask)
    return workload(target_config, layer_ids, DrafterShape.from_args(a), job.data.seq_len, job.drafter.num_anchors,
                    a.block_size, doc_len)


def stage_balance(job, target_config: dict, doc_len: int = 1024) -> float:
    """Mean over largest stage cost of the job's target split (`stages.plan_stages`); 1.0 unstaged."""
    if job.target.stages == 1:
        return 1.0
    layer_ids, _ = planned_ids(job, target_config)
    return plan_stages(target_config, layer_ids, job.target.stages, job.data.seq_len, doc_len).balance()


def target_config_for(job) -> dict:
    """The target's config.json fields of a resolved job (runtime.resolve): from the table for known
    hub ids, else read (no weights)."""
    return known_target_config(job.target.path) or load_target_config(job.target.path)


# MFUs of the two roles when nothing is measured: what the Qwen3-8B shapes reach on an H200 (the
# compiled target forward and the default-mode drafter step, BENCHMARKS.md).
TARGET_MFU, DRAFTER_MFU = 0.75, 0.70


def resolve_num_target_ranks(job, world_size: int) -> int:
    """`topology.num_target_ranks`, with "auto" replaced by the best whole-GPU split's target count
    (a multiple of `target.stages`: whole replicas)."""
    n = job.topology.num_target_ranks
    if n != "auto":
        if isinstance(n, str):
            raise ValueError(f"topology.num_target_ranks={n!r}: use an integer or 'auto'.")
        return n
    if world_size < 2:
        return 1  # Topology.plan raises with the fix
    tcfg = target_config_for(job)
    t, d = job_workload(job, tcfg).rates(job.logging.peak_tflops, TARGET_MFU, DRAFTER_MFU)
    stages = job.target.stages
    if stages == 1:
        n = best_whole_split(world_size, t, d)
        log.info("topology.num_target_ranks=auto -> %d (estimated %.3g target, %.3g drafter samples/s per GPU)",
                 n, t, d)
        return n
    balance = stage_balance(job, tcfg)
    n = best_whole_split(world_size, t, d, stages, balance)
    log.info("topology.num_target_ranks=auto -> %d = %d replica(s) x %d stages (estimated %.3g samples/s per "
             "replica at stage balance %.2f, %.3g drafter samples/s per GPU)",
             n, n // stages, stages, stages * t * balance, balance, d)
    return n


# --------------------------------------------------------------------------------------- measure
def measure_rates(job, target_config: dict, iters: int = 5) -> tuple[float, float]:
    """(target, drafter) samples/s on the local accelerator (CPU when there is none), random weights."""
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = resolve_dtype(job.target.dtype, dev)
    tc = target_config
    layer_ids, mask = planned_ids(job, tc)
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
    measure: bool = False  # time both on the local accelerator instead of estimating from FLOPs


def format_report(world: int, t: float, d: float, layouts: list[Layout], seq_len: int, stages: int = 1,
                  balance: float = 1.0) -> str:
    best = layouts[0]
    whole = best_whole_split(world, t, d, stages, balance)
    lines = [f"per GPU: target {t:.4g} samples/s, drafter {d:.4g} samples/s (1 sample = {seq_len} tokens)"]
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
    return "\n".join(lines)


def run_plan(job, opts: PlanConfig) -> None:
    job = resolve(job)  # builtin names -> real paths
    peak = job.logging.peak_tflops if opts.peak_tflops is None else opts.peak_tflops
    tcfg = target_config_for(job)
    if opts.measure:
        t, d = measure_rates(job, tcfg)
        print("measured on the local device")
    else:
        t, d = job_workload(job, tcfg, opts.doc_len).rates(peak, opts.target_mfu, opts.drafter_mfu)
        print(f"estimated from FLOPs at {peak:g} TFLOP/s, MFU target {opts.target_mfu:g} / "
              f"drafter {opts.drafter_mfu:g}")
    world = opts.world_size
    stages = job.target.stages
    balance = 1.0
    if stages > 1:
        layer_ids, _ = planned_ids(job, tcfg)
        stage_plan = plan_stages(tcfg, layer_ids, stages, job.data.seq_len, opts.doc_len)
        balance = stage_plan.balance()
        print(f"target.stages={stages}: {stage_plan.describe()}")
    print(format_report(world, t, d, plan_layouts(world, t, d, opts.shared_efficiency, stages, balance),
                        job.data.seq_len, stages, balance))


def main(argv: list[str] | None = None) -> None:
    tool_main("plan", PlanConfig, run_plan, __doc__, argv)


if __name__ == "__main__":
    entry(main)
