"""The two role runs. Every rank runs exactly one of them; the topology decides which.

`TargetRun` and `DrafterRun` build their parts in `__init__` (closed in reverse order by `close()`,
also when building fails half way), and `run()` is the step loop; `run_target(ctx)` / `run_drafter(ctx)`
build, run and close one.

Step plan: all ranks agree on `num_steps` drafter steps before the first batch moves. At drafter step
`s` drafter `d` consumes one batch from `topology.source_for_step(d, s)`; each target produces,
in that same order, exactly the batches its drafters will consume. A target's data cursor is
therefore a pure function of the drafter step, so only drafters need checkpoint state.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import process_options
from . import checkpoint as ckpt
from . import compile_cache, compile_output
from .compile_stats import cache_counts, describe_cache
from .compile_stats import counts as compile_counts
from .config import JobConfig
from .export import export_drafter, job_yaml
from .gpu_memory import give_back_cached
from .gpu_turns import GpuTurns
from .liveness import Liveness, NullLiveness, process_age_s
from .metrics import DrafterMetrics, Hiccups, Progress, TargetMetrics, make_writer, quiet_console
from .resilience import StopAgreement, StopSignal, effective_resume, fault_from_env, maybe_fault
from .stages import StagePlan, plan_stages
from .target import TargetSpec
from .topology import Topology
from .transport import SlotSpec, build_transport

log = logging.getLogger(__name__)

WARMUP_STEPS = 3  # steps after which the drafter must never compile again


@dataclass(frozen=True, eq=False)
class RunContext:
    """What both roles need, resolved once in main before any model loads; never changed after."""

    job: JobConfig
    topo: Topology
    device: torch.device
    target_path: str
    target_config: dict
    layer_ids: list[int]
    mask_token_id: int
    tokenizer: Any
    dtype: torch.dtype
    # The rank's liveness watcher: it hears this rank's phases and bounds every wait on a peer. None
    # (tests that build one role directly): phases go nowhere and the transport's timeouts bound waits.
    live: Liveness | None = None
    stop: StopSignal | None = None  # SIGTERM -> checkpoint and a clean exit
    run_id: str | None = None  # rundir.claim's: in checkpoint manifests, the export and scalar rows
    target_spec: TargetSpec | None = None  # runtime.Resolved.spec (parsed once there); None: tests' contexts

    @functools.cached_property  # a frozen dataclass still has a __dict__ for it
    def spec(self) -> TargetSpec:
        return self.target_spec or TargetSpec.from_config(self.target_config)

    @property
    def ckpt_root(self) -> str:
        return self.job.checkpoint.dir or os.path.join(self.job.run_dir, "checkpoints")

    @property
    def slot_spec(self) -> SlotSpec:
        width = len(self.layer_ids) * self.target_config["hidden_size"]
        return SlotSpec(seq_len=self.job.data.seq_len, hidden_dim=width, hidden_dtype=self.dtype,
                        device=self.device)

    @functools.cached_property
    def stage_plan(self) -> StagePlan:
        """The layers of each stage of a target replica (one stage: every layer)."""
        return plan_stages(self.target_config, self.layer_ids, self.topo.stages, self.job.data.seq_len)

    def link_spec(self, boundary: int) -> SlotSpec:
        """Messages from stage `boundary` to the next: residual stream plus the layers captured so far."""
        return SlotSpec(seq_len=self.job.data.seq_len, hidden_dim=self.stage_plan.boundary_width(boundary),
                        hidden_dtype=self.dtype, device=self.device)


def agree_num_steps(ctx: RunContext, batches_per_epoch: int) -> int:
    """All ranks: the number of drafter steps, from max_steps or epochs over all target shards."""
    topo = ctx.topo
    counts: list[int] = [0] * topo.world_size
    dist.all_gather_object(counts, batches_per_epoch, group=topo.control_group)
    total = sum(counts[r] for r in topo.target_ranks)
    if not topo.target_ranks:  # drafter-only job: the dump's manifest counts the batches of one epoch
        from .transport.files import read_manifest

        total = read_manifest(ctx.job.transport.files_dir)["num_batches"]
    tc = ctx.job.train
    steps = tc.max_steps if tc.max_steps > 0 else int(tc.epochs * total // len(topo.drafter_ranks))
    if steps < 1:
        raise ValueError(
            f"the data yields {total} packed batches per epoch for {len(topo.drafter_ranks)} drafter ranks: "
            "no step to run; add data, lower data.seq_len, or set train.max_steps."
        )
    return steps


# ----------------------------------------------------------------------------------------------- target
class _RoleRun:
    """What both role runs share: the parts built in `__init__` (an ExitStack), closed by `close()`."""

    _stack: ExitStack

    def close(self) -> None:
        self._stack.close()


class TargetRun(_RoleRun):
    """A target rank: tokenized data in, captured hidden states out to its drafters, in the exact
    order they consume them. No state to checkpoint: the data cursor follows the drafter step."""

    def __init__(self, ctx: RunContext):
        from .data import build_stream
        from .target import TargetWorker

        self.ctx = ctx
        job, topo = ctx.job, ctx.topo
        self.live = live = ctx.live or NullLiveness()
        quiet_console(False)  # the drafter leader's console carries the job's bars
        # A staged target (target.stages > 1): this rank runs one stage of its replica; only the first
        # stage reads data, the others take the previous stage's messages.
        self.stage = topo.stage_of(topo.rank)
        self.prev, self.next = topo.prev_stage(topo.rank), topo.next_stage(topo.rank)
        self.stream = None
        if self.prev is None:
            live.phase("loading", "tokenizing data")
            self.stream = build_stream(job.data, ctx.tokenizer, topo.replica_index(topo.rank), topo.num_replicas,
                                       vocab_limit=ctx.target_config["vocab_size"])
        self.num_steps = agree_num_steps(ctx, self.stream.batches_per_epoch(0) if self.stream else 0)
        self.start, _ = ckpt.resume_point(effective_resume(job.checkpoint.resume), ctx.ckpt_root)
        if self.stream is not None:
            seek(self.stream, topo.num_sends(topo.rank, self.start))
        layers = ctx.stage_plan.bounds[self.stage]
        if topo.stages > 1 and topo.rank == topo.target_ranks[0]:
            log.info("target stages (%d per replica): %s", topo.stages, ctx.stage_plan.describe())
        self.compiled = job.target.compile and ctx.device.type == "cuda"
        role = "target" if topo.stages == 1 else f"target-stage{self.stage}"  # each stage its own graphs
        self.cache_path = compile_cache.artifact_path(job.run_dir, role, ctx.device)
        if self.compiled:  # before the load, whose compiled-vs-eager check compiles the forward
            live.phase("loading", "compile cache")
            compile_cache.load(self.cache_path)
        live.phase("loading", "target weights" if topo.stages == 1 else f"target layers {layers[0]}-{layers[1] - 1}")
        out = (compile_output.to_file(compile_output.output_path(job.run_dir, topo.rank), "target compile")
               if self.compiled else contextlib.nullcontext())
        with out:
            self.worker = TargetWorker.load(ctx.target_path, ctx.layer_ids, ctx.device, ctx.dtype,
                                            job.target.attn_implementation, job.target.compile,
                                            job.target.packing_check, layers=layers,
                                            probe_len=job.data.seq_len * job.target.rows_per_forward,
                                            cuda_graph=job.target.cuda_graph,
                                            fold_norms=job.target.fold_norms)
        self.compiled = self.worker.compiled  # False where the compiled forward failed its check
        self.saves_cache = self.compiled and topo.replica_index(topo.rank) == 0
        live.phase("starting", "transport")
        with ExitStack() as stack:
            self.turns = GpuTurns.for_rank(topo, job.topology.gpu_turns, ctx.device, ctx.run_id)
            stack.callback(self.turns.close)
            self.sender = build_transport(job.transport, topo, ctx.slot_spec, ctx.live, ctx.link_spec)
            stack.callback(self.sender.close)
            self.upstream = self.sender.upstream
            self.writer = make_writer(job.logging.tensorboard, topo.is_role_leader,
                                      os.path.join(job.run_dir, "tb", "target"), ctx.run_id)
            stack.callback(self.writer.close)
            self.writer.add_text("config", f"```\n{job_yaml(job)}\n```", 0)  # a null writer off the leader
            self.writer.add_text("resolved", resolved_choices(ctx, self.turns, target=self.worker), 0)
            self.batches = iter(self.stream) if self.stream is not None else None
            self.fault = fault_from_env()
            self.agree = StopAgreement(ctx.stop, topo.control_group, job.logging.log_every, self.start, self.num_steps,
                                       ctx.live)
            stats = self.stream.stats() if self.stream is not None else {}
            self.skipped = {k.split("/", 1)[1]: v for k, v in stats.items() if k.startswith("skipped/")}
            self.metrics = TargetMetrics(self.writer, topo.target_group, topo.role_size, ctx.target_config,
                                         range(*layers), job.logging.peak_tflops, ctx.device, self.skipped,
                                         self.start)
            self.forwards = 0  # rows sent
            # this run's rows: pack_ahead packs no batch past the last
            self.num_forwards = (topo.num_sends(topo.rank, self.num_steps)
                                 - topo.num_sends(topo.rank, self.start))
            self.ahead: list = []  # the next forward's data rows, packed during the previous one (pack_ahead)
            self.rows_per_forward = job.target.rows_per_forward
            self.ready: list = []  # (HiddenBatch, its data row) forwarded with an earlier row, not sent yet
            self._stack = stack.pop_all()  # from here close() owns them

    def run(self) -> None:
        topo, log_every = self.ctx.topo, self.ctx.job.logging.log_every
        end = self.num_steps
        for step in range(self.start, self.num_steps):
            if self.agree.target_before(step):
                end = step
                break
            self.live.step(step)
            self.live.phase("training")
            maybe_fault(self.fault, topo.rank, step, "kill", "hang", "stall")
            for dst in topo.sends_at_step(topo.rank, step):
                batch = None if self.upstream is None else self.upstream.recv(self.prev)
                self.send(dst if self.next is None else self.next, batch, step)
            if (step + 1) % log_every == 0 or step + 1 == self.num_steps:
                stats = self.sender.stats()
                if self.upstream is not None:
                    stats["wait_ms"] = self.upstream.stats()["wait_ms"]
                self.metrics.flush(step + 1, stats)
        self.finish(end)

    def send(self, dst: int, batch, step: int) -> None:
        """Send `dst` its next row: `batch` (a later stage's: the previous stage's message) forwarded, or
        on a first stage the next data row, forwarded now or with an earlier one (`ready`)."""
        if not self.ready:
            rows, width = ([batch], 1) if batch is not None else (self.take_rows(), self.rows_per_forward)
            if self.forwards == 0:  # the first forward compiles: busy, not silent
                path = compile_output.output_path(self.ctx.job.run_dir, self.ctx.topo.rank)
                out = (compile_output.to_file(path, "target compile") if self.compiled
                       else contextlib.nullcontext())
                with self.live.during("compiling", "target forward"), out:
                    self.forward_rows(rows, width)
                    if self.saves_cache:
                        compile_cache.save(self.cache_path)
                startup_s = process_age_s()
                log.info("first target forward done %.1f s after the process started", startup_s)
                self.writer.add_scalar("time/startup_s", startup_s, step + 1)
            else:
                with self.turns.turn():  # a GPU shared with a drafter: the forward runs alone on it
                    self.forward_rows(rows, width)
                    self.pack_ahead()  # on the CPU, while the GPU runs the forward
        hb, pb = self.ready.pop(0)
        self.forwards += 1
        self.sender.send(dst, hb)
        self.metrics.update(pb, data=self.stream is not None)

    def forward_rows(self, rows: list, width: int) -> None:
        """One forward over `rows`; each row's HiddenBatch waits in `ready` with its data row."""
        self.ready = list(zip(self.worker.forward_rows(rows, width), rows))

    def take_rows(self) -> list:
        """The next forward's data rows: `target.rows_per_forward` of them, fewer past the run's last row
        (forward_rows makes the forward up to its width)."""
        n = min(self.rows_per_forward, self.num_forwards - self.forwards)
        return [self.next_batch() for _ in range(n)]

    def next_batch(self):
        """The next packed data batch: the one `pack_ahead` packed, else a new one."""
        return self.ahead.pop(0) if self.ahead else next(self.batches)

    def pack_ahead(self) -> None:
        """Pack the next forward's data rows now, inside the turn, if another forward follows this one.

        Packed after the send (milliseconds at 8B shapes), the next batch held back the
        target's next turn, and a drafter waiting on an empty ring could take the turn in that window:
        the two alternated with the ring empty, the drafter waiting a whole forward for each batch
        (BENCHMARKS.md, calls Z5 and Z9; `GpuTurns.first` is the other half of the mend). Packed here,
        the target asks for its next turn right after the send."""
        # Rows taken from the stream so far: sent, forwarded and waiting (`ready`), packed ahead.
        while (self.batches is not None and len(self.ahead) < self.rows_per_forward
               and self.forwards + len(self.ready) + len(self.ahead) < self.num_forwards):
            self.ahead.append(next(self.batches))

    def finish(self, end: int) -> None:
        rank = self.ctx.topo.rank
        self.agree.finish()
        if self.upstream is not None:
            self.upstream.expect_end(self.prev)
        self.sender.finish()
        if end < self.num_steps:
            log.warning("target rank %d stopped at step %d of %d (SIGTERM)", rank, end, self.num_steps)
        if self.stream is None:
            log.info("target rank %d done: steps %d..%d (stage %d, fed by rank %d)", rank, self.start, end,
                     self.stage, self.prev)
            return
        log.info("target rank %d done: steps %d..%d; data: %s", rank, self.start, end, self.stream.stats())
        log.info("data set: %d rows skipped%s", sum(self.skipped.values()),
                 "".join(f", {k}={v}" for k, v in sorted(self.skipped.items())))


def run_target(ctx: RunContext) -> None:
    process_options.apply(ctx.job.target, ctx.device, "target")  # before any GEMM and compile
    with contextlib.closing(TargetRun(ctx)) as run:
        run.run()


def seek(stream, num_batches: int) -> None:
    """Position the (deterministic) stream after `num_batches` emitted batches."""
    epoch = 0
    while num_batches >= stream.batches_per_epoch(epoch):
        num_batches -= stream.batches_per_epoch(epoch)
        epoch += 1
    stream.load_state_dict({"epoch": epoch, "batch": num_batches})


# ---------------------------------------------------------------------------------------------- drafter
def build_trainer(ctx: RunContext, num_steps: int):
    from .model import DFlashDrafter
    from .target import load_target_head
    from .trainer import DFlashObjective, DrafterTrainer, build_drafter_args

    job = ctx.job
    args = build_drafter_args(job.drafter, ctx.target_config, ctx.layer_ids, ctx.mask_token_id)
    torch.manual_seed(job.train.seed)  # identical init on every drafter rank
    with torch.device(ctx.device):  # initialise on the device: no CPU pass over a billion parameters
        drafter = DFlashDrafter(args)
    embed, head = load_target_head(ctx.target_path, ctx.dtype, ctx.device)
    objective = DFlashObjective(drafter, args, embed, head, job.drafter)
    trainer = DrafterTrainer(objective, job.train, num_steps, ctx.topo.drafter_group, ctx.device)
    log.info("drafter step: compile %s (%s scope), %s weights, loss kernel %s, optimizer update %s, CUDA graph %s",
             trainer.mode, job.train.compile_scope, trainer.precision, trainer.loss_kernel,
             "per layer on a side stream" if trainer.opt.on_side_stream else "after backward",
             trainer.describe_graph())
    # Anchor sampling differs per drafter rank, reproducibly.
    torch.manual_seed(job.train.seed + 1 + ctx.topo.role_rank)
    return trainer, args


class DrafterRun(_RoleRun):
    """A drafter rank: hidden states in, one optimizer step per batch, checkpoints, and at the end
    the export (role leader)."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        job, topo = ctx.job, ctx.topo
        self.live = live = ctx.live or NullLiveness()
        self.lead = lead = topo.is_role_leader
        quiet_console(job.logging.progress and lead)
        self.num_steps = agree_num_steps(ctx, 0)
        live.phase("loading", "drafter and the target's head")
        self.trainer, self.args = build_trainer(ctx, self.num_steps)
        self.fault = fault_from_env()
        self.checkpointer = ckpt.Checkpointer(
            ctx.ckpt_root, topo.rank, lead, topo.drafter_cpu_group, job.checkpoint.keep,
            {"world_size": topo.world_size, "target_ranks": list(topo.target_ranks), "run_id": ctx.run_id},
            self.fault, guard=self.protect)
        self.start, path = self.checkpointer.resolve(effective_resume(job.checkpoint.resume))
        if path is not None:
            self.checkpointer.load(path, self.trainer)  # from host memory, a tensor at a time
            give_back_cached(ctx.device, "resumed drafter")
            log.info("resumed from %s at step %d", path, self.start)
        with ExitStack() as stack:
            stack.callback(self.checkpointer.close)  # last: a write under way finishes
            live.phase("starting", "transport")
            self.turns = GpuTurns.for_rank(topo, job.topology.gpu_turns, ctx.device, ctx.run_id)
            stack.callback(self.turns.close)
            self.receiver = build_transport(job.transport, topo, ctx.slot_spec, ctx.live, ctx.link_spec)
            stack.callback(self.receiver.close)
            self.receiver.seek(self.start)
            self.writer = make_writer(job.logging.tensorboard, lead, os.path.join(job.run_dir, "tb", "drafter"),
                                      ctx.run_id, job.logging.curve_every)
            stack.callback(self.writer.close)
            bar = Progress(job.logging.progress and lead, self.num_steps, self.start, "drafter")
            stack.callback(bar.close)
            if lead:
                self.writer.add_text("config", f"```\n{job_yaml(job)}\n```", 0)
                self.writer.add_text("resolved", resolved_choices(ctx, self.turns, trainer=self.trainer,
                                                                  args=self.args), 0)
            self.compiled = self.trainer.mode != "eager"
            self.cache_path = compile_cache.artifact_path(job.run_dir, "drafter", ctx.device)
            self.shared = self.node_compile() if self.compiled else None
            if self.shared is not None and self.shared.leader:  # an earlier attempt's graphs: looked up
                with live.during("loading", "compile cache"):
                    self.shared.before_compile()
            self.metrics = DrafterMetrics(self.writer, bar, topo.drafter_group, topo.role_size, self.args,
                                          job.data.seq_len, job.drafter.num_anchors, job.logging.peak_tflops,
                                          ctx.device, self.start)
            self.metrics.mark_warm()  # also starts counting CUDA graph recordings
            self.hiccups = Hiccups()
            self.agree = StopAgreement(ctx.stop, topo.control_group, job.logging.log_every, self.start, self.num_steps,
                                       ctx.live)
            self._stack = stack.pop_all()  # from here close() owns them

    def run(self) -> None:
        every = self.ctx.job.checkpoint.every
        end = self.num_steps
        for step in range(self.start, self.num_steps):
            done = step + 1
            t0 = time.perf_counter()
            parts = self.train_step(step)
            if self.agree.drafter_after(done):  # SIGTERM somewhere: stop here with a checkpoint
                end = done
                break
            if every and done % every == 0 and done < self.num_steps:
                tc = time.perf_counter()
                with self.live.during("checkpointing", f"step {done}"):  # the copy; the write goes on behind
                    self.checkpointer.save(self.trainer, done, self.num_steps)
                parts["checkpointing"] = time.perf_counter() - tc
            if done - self.start > WARMUP_STEPS:
                self.hiccups.check(done, time.perf_counter() - t0, parts)
        self.finish(end)

    def train_step(self, step: int) -> dict[str, float]:
        """One step; returns the seconds of its phases that are not the step itself (for Hiccups)."""
        rank, done = self.ctx.topo.rank, step + 1
        self.live.step(step)
        self.live.phase("training")
        maybe_fault(self.fault, rank, step, "kill", "hang", "stall")
        tw = time.perf_counter()
        hb = self.receiver.recv(self.ctx.topo.source_for_step(rank, step))
        parts = {"waiting for data": time.perf_counter() - tw}
        self.metrics.update(hb, parts["waiting for data"])
        logs = done % self.ctx.job.logging.log_every == 0 or done == self.num_steps
        if done - self.start <= WARMUP_STEPS:  # compiles, autotunes, records graphs: busy, not silent
            first = done == self.start + 1
            if first and self.shared is not None and not self.shared.leader:
                with self.live.during("compiling", f"loading the graphs rank {self.shared_leader} compiles"):
                    self.shared.before_compile()
            with self.live.during("compiling", "drafter step"), self.compile_output():
                if first:
                    slow_compile_for_tests()
                # The node's compiling rank releases the others once forward and backward are compiled,
                # before the gradient all-reduce that needs them.
                release = self.shared.compiled if first and self.shared is not None else None
                lr = self.trainer.train_step(hb, timed=logs, after_backward=release)
                self.metrics.mark_warm()
                if done - self.start == WARMUP_STEPS and self.lead and self.compiled:  # everything is compiled now
                    compile_cache.save(self.cache_path)
            if done == self.start + 1:
                self.live.trained()  # a stop from now on has a step to save
                startup_s = process_age_s()
                log.info("first drafter step done %.1f s after the process started (its batch came after %.1f s; "
                         "%s)", startup_s, startup_s - (time.perf_counter() - tw - parts["waiting for data"]),
                         describe_cache(cache_counts()))
                self.writer.add_scalar("time/startup_s", startup_s, done)
        else:  # after warm-up, on a GPU shared with a target: the step runs alone on it (gpu_turns.py)
            with self.turns.turn():
                lr = self.trainer.train_step(hb, timed=logs)  # the step before each log shows where time goes
        if logs:
            tl = time.perf_counter()
            self.receiver.verify()
            self.metrics.flush(done, self.trainer, lr, final=done == self.num_steps)
            parts["logging"] = time.perf_counter() - tl
        return parts

    def node_compile(self) -> compile_cache.SharedCompile:
        """The first drafter rank of each node compiles; the node's other drafter ranks load its graphs."""
        topo = self.ctx.topo
        node = topo.rank // topo.ranks_per_node
        self.shared_leader = min(r for r in topo.drafter_ranks if r // topo.ranks_per_node == node)
        return compile_cache.SharedCompile(self.cache_path, dist.distributed_c10d._get_default_store(),
                                           f"compiled/drafter/node{node}", leader=topo.rank == self.shared_leader)

    def compile_output(self):
        """A compile's native output (ptxas, the C++ compiler) to this rank's file, not the console."""
        if not self.compiled:
            return contextlib.nullcontext()
        path = compile_output.output_path(self.ctx.job.run_dir, self.ctx.topo.rank)
        return compile_output.to_file(path, "drafter compile")

    def finish(self, end: int) -> None:
        """End of data from every source, the last checkpoint, and the export when the run is complete."""
        self.live.phase("training", "end of data")
        for src in self.ctx.topo.sources[self.ctx.topo.rank]:
            self.receiver.expect_end(src)
        c = compile_counts()
        log.info("compile: %d graphs, %d recompiles after warm-up, %d CUDA graph recordings (mode %s)",
                 c["graphs"], self.metrics.recompiles(), c["cudagraph_records"], self.trainer.mode)
        self.live.phase("checkpointing", f"step {end}")
        with self.protect("the final checkpoint and export"):  # a stop now waits for them: exit 0
            self.checkpointer.save(self.trainer, end, self.num_steps, wait=True)
            log.info("final checkpoint of step %d written in %.1f s", end, self.checkpointer.last_s)
            if end < self.num_steps:
                log.warning("stopped at step %d of %d (SIGTERM) with a checkpoint; continue with "
                            "checkpoint.resume=auto", end, self.num_steps)
                return
            if self.lead:
                self.export()

    def protect(self, what: str):
        """A section a stop lets finish (resilience.StopSignal.protect)."""
        return self.ctx.stop.protect(what) if self.ctx.stop is not None else contextlib.nullcontext()

    def export(self) -> None:
        job, out = self.ctx.job, os.path.join(self.ctx.job.run_dir, "export")
        export_drafter(self.trainer.objective.drafter, self.args, out, self.ctx.target_config,
                       state=self.trainer.master_state_dict(), run_id=self.ctx.run_id,
                       chat_template_kwargs=job.data.chat_template_kwargs)
        log.info("exported drafter to %s", out)


def run_drafter(ctx: RunContext) -> None:
    process_options.apply(ctx.job.train, ctx.device, "train")  # before any GEMM and compile
    with contextlib.closing(DrafterRun(ctx)) as run:
        run.run()


def slow_compile_for_tests() -> None:
    """DFLASH_MP_SLOW_COMPILE_S=<s>: the first drafter step takes <s> seconds longer, as a cold
    compile on a fresh node does (tests of the liveness rules)."""
    delay = float(os.environ.get("DFLASH_MP_SLOW_COMPILE_S", "0") or 0)
    if delay > 0:
        log.warning("test hook: first step held for %.0f s (DFLASH_MP_SLOW_COMPILE_S)", delay)
        time.sleep(delay)


def resolved_choices(ctx: RunContext, turns: GpuTurns, trainer=None, args=None, target=None) -> str:
    """What the run chose where the config says auto/null, as a markdown table (TensorBoard's Text
    tab, next to the config): the role's own choices (its GPU turns; a drafter passes its trainer and
    drafter args, a target its TargetWorker) plus the job-wide ones."""
    from .transport import pair_kinds

    job, topo, spec = ctx.job, ctx.topo, ctx.spec
    rows = [("device", str(ctx.device)), ("hidden-state dtype", str(ctx.dtype).replace("torch.", "")),
            ("process groups (backend)", ", ".join(f"{k} {v}" for k, v in topo.backends.items()) or "none")]
    if job.transport.kind == "files":
        rows.append(("transport", f"files from {job.transport.files_dir}"))
    else:
        kinds = pair_kinds(job.transport, topo)
        pairs = ", ".join(f"{t}->{d} {k}" for (t, d), k in sorted(kinds.items()))
        rows.append(("transport per pair (target->drafter)", pairs))
    rows.append(("GPU turns (ranks sharing this rank's GPU)", turns.why))
    if topo.stages > 1:
        rows.append(("target stages (per replica)", f"{topo.stages}: {ctx.stage_plan.describe()}"))
    rows += [("target layers captured", str(list(ctx.layer_ids))), ("mask token id", str(ctx.mask_token_id)),
             ("target hidden size", str(spec.hidden_size)),
             ("target attention heads / kv heads", f"{spec.num_heads} / {spec.num_kv_heads}"),
             ("target head dim", str(spec.head_dim))]
    if target is not None:
        rows += [("target attention implementation", target.attention),
                 *process_options.describe(ctx.device, "target"),
                 ("target linear-attention layers", target.linear_how),
                 ("target forward compiled", f"yes ({target.compile_scope} scope)" if target.compiled else "no"),
                 ("target forward as a CUDA graph", target.describe_graph())]
    if trainer is not None:
        rows += [("drafter compile mode", f"{trainer.mode} ({job.train.compile_scope} scope)"),
                 ("drafter precision (weights)", trainer.precision), ("loss kernel", trainer.loss_kernel),
                 *process_options.describe(ctx.device, "drafter"),
                 ("drafter attention", trainer.objective.attention),
                 ("optimizer update", "per layer on a side stream" if trainer.opt.on_side_stream else "after backward"),
                 ("drafter step as a CUDA graph", trainer.describe_graph())]
    if args is not None:
        rows += [("drafter layers / hidden / heads / kv heads / head dim",
                  f"{args.num_layers} / {args.hidden_size} / {args.num_heads} / {args.num_kv_heads} / {args.head_dim}"),
                 ("block size", str(args.block_size))]
    return "| choice | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
