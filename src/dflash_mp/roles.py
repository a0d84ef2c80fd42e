"""The two role loops. Every rank runs exactly one of them; the topology decides which.

Step plan: all ranks agree on `num_steps` drafter steps before the first batch moves. At drafter step
`s` drafter `d` consumes one batch from `topology.source_for_step(d, s)`; each target produces,
in that same order, exactly the batches its drafters will consume. A target's data cursor is
therefore a pure function of the drafter step, so only drafters need checkpoint state.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from . import compile_cache
from .config import JobConfig
from .flops import DrafterShape, causal_pairs_packed, drafter_attention_flops, drafter_matmul_flops, target_forward_flops
from .compile_stats import counts as compile_counts
from .liveness import NullLiveness, process_age_s
from .metrics import Progress, make_writer, quiet_console, reduce_scalars
from .resilience import DataTally, StopAgreement, effective_resume, fault_from_env, maybe_fault
from .topology import Topology
from .transport import SlotSpec, build_transport

log = logging.getLogger(__name__)

WARMUP_STEPS = 3  # steps after which the drafter must never compile again


class RunContext:
    """What both roles need, resolved once in main before any model loads."""

    def __init__(self, job: JobConfig, topo: Topology, device: torch.device, target_path: str,
                 target_config: dict, layer_ids: list[int], mask_token_id: int, tokenizer, dtype: torch.dtype,
                 live=None):
        self.job, self.topo, self.device = job, topo, device
        self.target_path, self.target_config = target_path, target_config
        self.layer_ids, self.mask_token_id = layer_ids, mask_token_id
        self.tokenizer, self.dtype = tokenizer, dtype
        self.ckpt_root = job.checkpoint.dir or os.path.join(job.run_dir, "checkpoints")
        self.graphs_after_warmup = 0
        self.stop = None  # resilience.StopSignal: SIGTERM -> checkpoint and a clean exit
        self.watcher = live  # liveness.Liveness where one runs: it bounds every wait on a peer
        self.live = live or NullLiveness()  # this rank's phase, for the watchers of every rank
        self.run_id = None  # rundir.claim's: in checkpoint manifests, the export and scalar rows

    @property
    def slot_spec(self) -> SlotSpec:
        width = len(self.layer_ids) * self.target_config["hidden_size"]
        return SlotSpec(seq_len=self.job.data.seq_len, hidden_dim=width, hidden_dtype=self.dtype,
                        device=self.device)


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


def resume_step(ctx: RunContext) -> tuple[int, str | None]:
    path = ckpt.resolve_resume(effective_resume(ctx.job.checkpoint.resume), ctx.ckpt_root)
    if path is None:
        return 0, None
    return int(ckpt.read_manifest(path)["step"]), path


# ----------------------------------------------------------------------------------------------- target
def run_target(ctx: RunContext) -> None:
    from .data import build_stream
    from .target import TargetWorker

    job, topo, live = ctx.job, ctx.topo, ctx.live
    quiet_console(False)  # the drafter leader's console carries the job's bars
    live.phase("loading", "tokenizing data")
    stream = build_stream(job.data, ctx.tokenizer, topo.role_rank, topo.role_size,
                          vocab_limit=ctx.target_config["vocab_size"])
    num_steps = agree_num_steps(ctx, stream.batches_per_epoch(0))
    start, _ = resume_step(ctx)
    seek(stream, topo.num_sends(topo.rank, start))
    live.phase("loading", "target weights")
    worker = TargetWorker.load(ctx.target_path, ctx.layer_ids, ctx.device, ctx.dtype,
                               job.target.attn_implementation, job.target.compile, job.target.packing_check)
    compiled = job.target.compile and ctx.device.type == "cuda"
    cache_path = compile_cache.artifact_path(job.run_dir, "target", ctx.device)
    if compiled:
        live.phase("loading", "compile cache")
        compile_cache.load(cache_path)
    live.phase("starting", "transport")
    tc = ctx.target_config
    fwd_flops = lambda pb: target_forward_flops(  # noqa: E731
        tc["hidden_size"], tc["intermediate_size"], max(ctx.layer_ids) + 1, tc["num_attention_heads"],
        tc.get("num_key_value_heads") or tc["num_attention_heads"],
        tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"], pb.seq_len,
        causal_pairs_packed(torch.bincount(pb.doc_ids[pb.doc_ids >= 0]).tolist()))
    with ExitStack() as stack:
        sender = build_transport(job.transport, topo, ctx.slot_spec, ctx.watcher)
        stack.callback(sender.close)
        writer = make_writer(job.logging.tensorboard, topo.is_role_leader, os.path.join(job.run_dir, "tb", "target"),
                             ctx.run_id)
        stack.callback(writer.close)
        writer.add_text("config", f"```\n{_yaml(job)}\n```", 0)  # a null writer off the leader
        writer.add_text("resolved", resolved_choices(ctx), 0)
        it = iter(stream)
        fault = fault_from_env()
        agree = StopAgreement(ctx.stop, topo.control_group, job.logging.log_every, start, num_steps, ctx.watcher)
        skipped = {k.split("/", 1)[1]: v for k, v in stream.stats().items() if k.startswith("skipped/")}
        t0, tokens, flops, docs, last = time.perf_counter(), 0, 0.0, 0, start
        end = num_steps
        for step in range(start, num_steps):
            if agree.target_before(step):
                end = step
                break
            live.step(step)
            live.phase("training")
            maybe_fault(fault, topo.rank, step, "kill")
            maybe_fault(fault, topo.rank, step, "hang")
            for dst in topo.sends_at_step(topo.rank, step):
                pb = next(it)
                if step == start and tokens == 0:  # the first forward compiles: busy, not silent
                    with live.during("compiling", "target forward"):
                        hb = worker.forward(pb)
                        if compiled and topo.is_role_leader:
                            compile_cache.save(cache_path)
                    startup_s = process_age_s()
                    log.info("first target forward done %.1f s after the process started", startup_s)
                    writer.add_scalar("time/startup_s", startup_s, step + 1)
                else:
                    hb = worker.forward(pb)
                sender.send(dst, hb)
                tokens += pb.num_valid_tokens
                docs += pb.num_docs
                flops += fwd_flops(pb)
            if (step + 1) % job.logging.log_every == 0 or step + 1 == num_steps:
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                st = sender.stats()
                vals = reduce_scalars({"tokens_per_s": tokens / dt, "mfu": flops / dt / (job.logging.peak_tflops * 1e12),
                                       # per step, like the drafter's comm/wait_ms
                                       "stall_ms": st.get("stall_ms", 0.0) / (step + 1 - last),
                                       "in_flight": st.get("in_flight", 0),
                                       "docs": docs, "tokens": tokens}, topo.target_group)
                # Rows and documents sent in this interval (all targets), and the rows the data set
                # skipped, by reason (every target tokenizes the whole set: the counts agree).
                writer.add_scalar("data/docs", round(vals["docs"] * topo.role_size), step + 1)
                writer.add_scalar("data/tokens", round(vals["tokens"] * topo.role_size), step + 1)
                for reason, n in sorted(skipped.items()):
                    writer.add_scalar(f"data/skipped_{reason}", n, step + 1)
                writer.add_scalar("target/tokens_per_s", vals["tokens_per_s"] * topo.role_size, step + 1)
                writer.add_scalar("target/mfu", vals["mfu"], step + 1)
                writer.add_scalar("comm/stall_ms", vals["stall_ms"], step + 1)
                writer.add_scalar("comm/in_flight", vals["in_flight"], step + 1)
                writer.flush()
                t0, tokens, flops, docs, last = time.perf_counter(), 0, 0.0, 0, step + 1
        agree.finish()
        sender.finish()
        if end < num_steps:
            log.warning("target rank %d stopped at step %d of %d (SIGTERM)", topo.rank, end, num_steps)
        log.info("target rank %d done: steps %d..%d; data: %s", topo.rank, start, end, stream.stats())
        log.info("data set: %d rows skipped%s", sum(skipped.values()),
                 "".join(f", {k}={v}" for k, v in sorted(skipped.items())))


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
    log.info("drafter step: compile %s (%s scope), %s weights, loss kernel %s, optimizer update %s",
             trainer.mode, job.train.compile_scope, trainer.precision, trainer.loss_kernel,
             "per layer on a side stream" if trainer.opt.on_side_stream else "after backward")
    # Anchor sampling differs per drafter rank, reproducibly.
    torch.manual_seed(job.train.seed + 1 + ctx.topo.role_rank)
    return trainer, args


def run_drafter(ctx: RunContext) -> None:
    from .export import export_drafter

    job, topo, live = ctx.job, ctx.topo, ctx.live
    quiet_console(job.logging.progress and topo.is_role_leader)
    num_steps = agree_num_steps(ctx, 0)
    live.phase("loading", "drafter and the target's head")
    trainer, args = build_trainer(ctx, num_steps)
    start, path = resume_step(ctx)
    if path is not None:
        trainer.load_state_dict(ckpt.load_file(path, "drafter.pt", map_location=ctx.device))
        set_rng_state(ckpt.load_file(path, f"rng_rank{topo.rank}.pt"))
        log.info("resumed from %s at step %d", path, start)
    shape = DrafterShape(args.hidden_size, args.intermediate_size, args.num_layers, args.num_heads,
                         args.num_kv_heads, args.head_dim, args.vocab_size, args.num_target_layers)
    step_flops = drafter_matmul_flops(shape, job.data.seq_len, job.drafter.num_anchors, args.block_size)
    with ExitStack() as stack:
        live.phase("starting", "transport")
        receiver = build_transport(job.transport, topo, ctx.slot_spec, ctx.watcher)
        stack.callback(receiver.close)
        if hasattr(receiver, "seek"):  # files: no target to re-position, the reader seeks itself
            receiver.seek(start)
        lead = topo.is_role_leader
        writer = make_writer(job.logging.tensorboard, lead, os.path.join(job.run_dir, "tb", "drafter"), ctx.run_id,
                             job.logging.curve_every)
        stack.callback(writer.close)
        bar = Progress(job.logging.progress and lead, num_steps, start, "drafter")
        stack.callback(bar.close)
        if lead:
            writer.add_text("config", f"```\n{_yaml(job)}\n```", 0)
            writer.add_text("resolved", resolved_choices(ctx, trainer=trainer, args=args), 0)
        compiled = trainer.mode != "eager"
        cache_path = compile_cache.artifact_path(job.run_dir, "drafter", ctx.device)
        if compiled:  # graphs another rank, node or attempt compiled: looked up instead of compiled
            with live.during("loading", "compile cache"):
                compile_cache.load(cache_path)
        ctx.graphs_after_warmup = compile_counts()["graphs"]  # also starts counting CUDA graph recordings
        t0, wait_s, last_logged, log_ms = time.perf_counter(), 0.0, start, None
        fault = fault_from_env()
        agree = StopAgreement(ctx.stop, topo.control_group, job.logging.log_every, start, num_steps, ctx.watcher)
        tally = DataTally(ctx.device)
        end = num_steps
        for step in range(start, num_steps):
            live.step(step)
            live.phase("training")
            maybe_fault(fault, topo.rank, step, "kill")
            maybe_fault(fault, topo.rank, step, "hang")
            tw = time.perf_counter()
            hb = receiver.recv(topo.source_for_step(topo.rank, step))
            wait_s += time.perf_counter() - tw
            tally.add(hb)
            done = step + 1
            logs = done % job.logging.log_every == 0 or done == num_steps
            if done - start <= WARMUP_STEPS:  # compiles, autotunes, records graphs: busy, not silent
                with live.during("compiling", "drafter step"):
                    if done == start + 1:
                        slow_compile_for_tests()
                    lr = trainer.train_step(hb, timed=logs)
                    ctx.graphs_after_warmup = compile_counts()["graphs"]
                    if done - start == WARMUP_STEPS and lead and compiled:  # everything is compiled now
                        compile_cache.save(cache_path)
                if done == start + 1:
                    startup_s = process_age_s()
                    log.info("first drafter step done %.1f s after the process started", startup_s)
                    writer.add_scalar("time/startup_s", startup_s, done)
            else:
                lr = trainer.train_step(hb, timed=logs)  # the step before each log shows where time goes
            if logs:
                receiver_verify(receiver)
                tl = time.perf_counter()
                vals = log_drafter(ctx, trainer, writer, done, lr, tl - t0, wait_s,
                                   step_flops, shape, args.block_size, tally, log_ms, final=done == num_steps)
                bar.update(done - last_logged, {"loss": vals["loss"], "tau": vals["tau_sim"]})
                t0, wait_s, last_logged = time.perf_counter(), 0.0, done
                log_ms = 1000 * (t0 - tl)
            if agree.drafter_after(done):  # SIGTERM somewhere: stop here with a checkpoint
                end = done
                break
            if job.checkpoint.every and done % job.checkpoint.every == 0 and done < num_steps:
                with live.during("checkpointing", f"step {done}"):
                    save_checkpoint(ctx, trainer, done, num_steps, fault)
        live.phase("training", "end of data")
        for src in topo.sources[topo.rank]:
            receiver.expect_end(src)
        c = compile_counts()
        log.info("compile: %d graphs, %d recompiles after warm-up, %d CUDA graph recordings (mode %s)",
                 c["graphs"], c["graphs"] - ctx.graphs_after_warmup, c["cudagraph_records"], trainer.mode)
        live.phase("checkpointing", f"step {end}")
        save_checkpoint(ctx, trainer, end, num_steps, fault)
        if end < num_steps:
            log.warning("stopped at step %d of %d (SIGTERM) with a checkpoint; continue with "
                        "checkpoint.resume=auto", end, num_steps)
            return
        if lead:
            out = os.path.join(job.run_dir, "export")
            export_drafter(trainer.objective.drafter, args, out, ctx.target_config,
                           state=trainer.master_state_dict(), run_id=ctx.run_id,
                           chat_template_kwargs=job.data.chat_template_kwargs)
            log.info("exported drafter to %s", out)


def slow_compile_for_tests() -> None:
    """DFLASH_MP_SLOW_COMPILE_S=<s>: the first drafter step takes <s> seconds longer, as a cold
    compile on a fresh node does (tests of the liveness rules)."""
    delay = float(os.environ.get("DFLASH_MP_SLOW_COMPILE_S", "0") or 0)
    if delay > 0:
        log.warning("test hook: first step held for %.0f s (DFLASH_MP_SLOW_COMPILE_S)", delay)
        time.sleep(delay)


def receiver_verify(receiver) -> None:
    verify = getattr(receiver, "verify", None)
    if verify is not None:
        verify()


def log_drafter(ctx, trainer, writer, step, lr, dt, wait_s, step_flops, shape, b, tally=None,
                log_ms=None, final=False) -> dict[str, float]:
    """`log_ms`: host time the previous logging step took (sync, reductions, writes), None at first.
    `final`: the run's last step (the acceptance curve is drawn there whatever `curve_every` says)."""
    topo = ctx.topo
    phases = trainer.phase_ms()  # before the reductions below: reads events the last step recorded
    s = trainer.stats.pop()
    if tally is not None:
        s.update(tally.pop())  # same all-reduce
    tot = reduce_scalars(s, topo.drafter_group, mode="sum")
    n = topo.role_size
    steps = tot["steps"] / n  # every drafter runs the same steps
    vals = {
        "loss": tot["loss_sum"] / max(tot["steps"], 1),
        "grad_norm": tot["gnorm_sum"] / max(tot["steps"], 1),
        "tau_sim": tot["tau_sum"] / max(tot["blocks"], 1),
    }
    writer.add_scalar("drafter/loss", vals["loss"], step)
    writer.add_scalar("drafter/grad_norm", vals["grad_norm"], step)
    writer.add_scalar("drafter/tau_sim", vals["tau_sim"], step)
    writer.add_scalar("drafter/lr", lr, step)
    writer.add_scalar("drafter/skipped_steps", tot["skipped"] / n, step)  # non-finite gradients, update skipped
    accs = [tot[f"slot_correct_{k}"] / max(tot[f"slot_count_{k}"], 1) for k in range(1, b)]
    for k, acc in enumerate(accs, start=1):
        writer.add_scalar(f"drafter/acc_slot_{k}", acc, step)
    writer.acceptance(step, accs, vals["tau_sim"], final)
    # Wall time is the slowest rank's, but all ranks are in lock-step through the all-reduce.
    samples = tot["steps"]
    vis_pairs = shape.num_layers * (tot["ctx_keys"] * b + tot["blocks"] * b * b)
    flops = samples * step_flops + drafter_attention_flops(shape, vis_pairs)
    writer.add_scalar("throughput/samples_per_s", samples / dt, step)
    writer.add_scalar("throughput/tokens_per_s", samples * ctx.job.data.seq_len / dt, step)
    writer.add_scalar("throughput/mfu", flops / n / dt / (ctx.job.logging.peak_tflops * 1e12), step)
    writer.add_scalar("comm/wait_ms", 1000 * wait_s / max(steps, 1), step)
    # Where the last step's time went (this rank; GPU time between events on CUDA), and what logging costs.
    for name, ms in phases.items():
        writer.add_scalar(f"time/{name}_ms", ms, step)
    if log_ms is not None:
        writer.add_scalar("time/logging_ms", log_ms, step)
    if tally is not None:  # what the drafters consumed in this interval: proves nothing lost or repeated
        writer.add_scalar("data/docs", tot["data_docs"], step)
        writer.add_scalar("data/tokens", tot["data_tokens"], step)
        writer.add_row("data/checksum", tot["data_checksum"], step)  # for tests and scripts: no chart
    c = compile_counts()
    writer.add_scalar("compile/graphs", c["graphs"], step)
    writer.add_scalar("compile/cudagraph_records", c["cudagraph_records"], step)
    writer.add_scalar("compile/recompiles", c["graphs"] - ctx.graphs_after_warmup, step)
    if ctx.device.type == "cuda":
        writer.add_scalar("memory/max_reserved_gib", torch.cuda.max_memory_reserved(ctx.device) / 2**30, step)
    writer.flush()
    return vals


def resolved_choices(ctx: RunContext, trainer=None, args=None) -> str:
    """What the run chose where the config says auto/null, as a markdown table (TensorBoard's Text
    tab, next to the config): the role's own choices (a drafter passes its trainer and drafter args)
    plus the job-wide ones."""
    from .target import resolve_attn
    from .transport import pair_kinds

    job, topo, tc = ctx.job, ctx.topo, ctx.target_config
    rows = [("device", str(ctx.device)), ("hidden-state dtype", str(ctx.dtype).replace("torch.", "")),
            ("process groups (backend)", ", ".join(f"{k} {v}" for k, v in topo.backends.items()) or "none")]
    if job.transport.kind == "files":
        rows.append(("transport", f"files from {job.transport.files_dir}"))
    else:
        kinds = pair_kinds(job.transport, topo)
        pairs = ", ".join(f"{t}->{d} {k}" for (t, d), k in sorted(kinds.items()))
        rows.append(("transport per pair (target->drafter)", pairs))
    rows += [("target layers captured", str(list(ctx.layer_ids))), ("mask token id", str(ctx.mask_token_id)),
             ("target hidden size", str(tc["hidden_size"])),
             ("target attention heads / kv heads", f'{tc["num_attention_heads"]} / '
                                                     f'{tc.get("num_key_value_heads") or tc["num_attention_heads"]}'),
             ("target head dim", str(tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]))]
    if topo.role == "target":
        rows += [("target attention implementation", resolve_attn(job.target.attn_implementation, ctx.device)),
                 ("target forward compiled", str(job.target.compile and ctx.device.type == "cuda").lower())]
    if trainer is not None:
        rows += [("drafter compile mode", f"{trainer.mode} ({job.train.compile_scope} scope)"),
                 ("drafter precision (weights)", trainer.precision), ("loss kernel", trainer.loss_kernel),
                 ("optimizer update", "per layer on a side stream" if trainer.opt.on_side_stream else "after backward")]
    if args is not None:
        rows += [("drafter layers / hidden / heads / kv heads / head dim",
                  f"{args.num_layers} / {args.hidden_size} / {args.num_heads} / {args.num_kv_heads} / {args.head_dim}"),
                 ("block size", str(args.block_size))]
    return "| choice | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def save_checkpoint(ctx: RunContext, trainer, step: int, num_steps: int, fault=None) -> None:
    topo, root = ctx.topo, ctx.ckpt_root
    tmp = ckpt.tmp_dir(root, step)
    os.makedirs(tmp, exist_ok=True)
    ckpt.save_file(get_rng_state(), os.path.join(tmp, f"rng_rank{topo.rank}.pt"))
    maybe_fault(fault, topo.rank, step, "checkpoint")  # tests: die between two files of one checkpoint
    if topo.is_role_leader:
        ckpt.save_file(trainer.state_dict(), os.path.join(tmp, "drafter.pt"))
    dist.barrier(group=topo.drafter_cpu_group)
    if topo.is_role_leader:
        ckpt.commit(root, step, {"num_steps": num_steps, "world_size": topo.world_size,
                                 "target_ranks": list(topo.target_ranks), "run_id": ctx.run_id},
                    ctx.job.checkpoint.keep)


def get_rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _yaml(job: JobConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(job))
