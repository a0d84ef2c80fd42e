"""Entry point for every rank: `torchrun --nproc-per-node N -m dflash_mp.main [hydra overrides]`.

Compose config -> validate (before any process group or model) -> init distributed -> build the
topology's groups -> run this rank's role -> always tear down.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from . import checkpoint as ckpt
from . import rundir
from .cli import freeze_for_exit
from .config import CONF_DIR, JobConfig, register, to_job
from .gpu_turns import gpu_mates
from .liveness import Liveness, peer_error
from .metrics import quiet_console
from .resilience import StopSignal, effective_resume, restart_count
from .roles import RunContext, run_drafter, run_target
from .runtime import (attempt_store, init_distributed, pick_device, prepare, resolve_backend, setup_logging,
                      watcher_store)
from .split import resolve_num_target_ranks
from .topology import Topology
from .transport import p2p_pairs

log = logging.getLogger("dflash_mp")


def out_of_memory(e: BaseException | None) -> bool:
    """Whether `e`, or an exception it was raised from, is CUDA running out of memory (the allocator's
    OutOfMemoryError, or a CUDA call's "out of memory" error, as cuBLAS or NCCL hand it on)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError) or "CUDA error: out of memory" in str(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def explain_oom(e: Exception, topo: Topology, job: JobConfig | None = None) -> Exception:
    """`e` with the fix named when it is CUDA running out of memory: a GPU that several processes share
    (each holds its own model), a target alone on its GPU (its layers may need more than one:
    target.stages), or a drafter alone on its GPU (`job`'s knobs of the step's memory, the one that
    keeps the training the same first)."""
    where = topo.gpu_of(topo.rank)
    if where is None or not out_of_memory(e):
        return e
    node, gpu = where
    mates = gpu_mates(topo, topo.rank)
    if len(mates) > 1:
        why = (f"GPU {gpu} of node {node} holds {len(mates)} processes ({', '.join(topo.name(r) for r in mates)}), "
               f"each with its own model, and they do not fit in its memory together: give each process a GPU of "
               f"its own (this node has {topo.gpus_per_node} for {topo.ranks_per_node} processes) or use GPUs with "
               "more memory.")
    elif topo.role == "target":
        why = (f"{topo.name(topo.rank)} has GPU {gpu} of node {node} to itself and its share of the target's layers "
               f"does not fit: split the target over more GPUs with a larger target.stages (now {topo.stages}; "
               "each stage holds only its layers).")
    elif job is not None:
        d = job.drafter
        why = (f"{topo.name(topo.rank)} has GPU {gpu} of node {node} to itself and its training step does not fit: "
               f"lower drafter.loss_chunk_size (now {d.loss_chunk_size}; the same training, the LM head in smaller "
               f"pieces), else drafter.num_anchors (now {d.num_anchors}) or data.seq_len (now {job.data.seq_len}), "
               "which change what a step trains on, or use GPUs with more memory.")
    else:
        return e
    out = torch.OutOfMemoryError(f"{why} {e}")
    out.__cause__ = e
    return out.with_traceback(e.__traceback__)


def run(job: JobConfig, raw: DictConfig | None = None) -> None:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # Before anything slow: Slurm may signal early. A checkpoint under way holds the exit back up to its bound.
    stop = StopSignal(job.train.stop_grace_s, job.liveness.checkpointing_s).install()
    stop.none_trained = lambda: True  # until the watcher below knows better: set-up trains nothing
    device = pick_device(local_rank)
    # The target, once: builtin names -> real paths, its config, tokenizer, captured layers and mask
    # token, validated. The planner and every role read these; nothing derives them again.
    res = prepare(job, device)
    job = res.job
    n_targets = resolve_num_target_ranks(job, world, res.target_config, res.spec, res.layer_ids, res.mask_token_id)
    topo = Topology.plan(n_targets, rank, world, local_world, allow_no_target=job.transport.kind == "files",
                         stages=job.target.stages)
    setup_logging(rank, "T" if topo.role == "target" else "D", job.run_dir)
    quiet_console(rank == topo.drafter_ranks[0])  # one set of progress bars per job, before any model loads
    timeout_s = job.topology.timeout_s or (1800.0 if device.type == "cuda" else 120.0)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = attempt_store(rank, world, timeout)
    rundir.use_store(store)  # the run dir's claim and the one console line per fatal error agree through it
    backend = resolve_backend(job.topology.backend, device, local_world, job.transport.kind)
    topo = dataclasses.replace(topo, gpus_per_node=torch.cuda.device_count() if device.type == "cuda" else 0)
    p2p_pairs(job.transport, topo)  # a transport the placement cannot carry fails before any group

    resume = effective_resume(job.checkpoint.resume)
    if resume != job.checkpoint.resume:
        log.warning("torchrun restart %d: resuming from the newest complete checkpoint (checkpoint.resume=auto)",
                    restart_count())
    job.checkpoint.resume = resume
    run_id = rundir.claim(job, rank, resume)  # lock, ownership and run id, before any group
    ckpt.validate_resume(resume, job.checkpoint.dir or os.path.join(job.run_dir, "checkpoints"),
                         topo.drafter_ranks, world)  # a missing or torn checkpoint fails before any group

    names = {r: topo.name(r) for r in range(world)}
    live = Liveness(watcher_store(datetime.timedelta(seconds=60)), rank, world, names, job.liveness,
                    job.transport.timeout_s).start()
    stop.peers_busy = lambda: live.peers_in("checkpointing")  # a stop waits for the drafters' last checkpoint
    stop.none_trained = lambda: live.none_trained(topo.drafter_ranks)  # a stop during start-up loses nothing
    stop.on_clean_exit = live.done
    try:
        init_distributed(job, topo, device, backend, live, store, timeout)
        if rank == 0:
            log.info("topology: %s; backend %s; layers %s; mask token %d", topo.describe(), backend, res.layer_ids,
                     res.mask_token_id)
            os.makedirs(job.run_dir, exist_ok=True)
            if raw is not None:
                with open(os.path.join(job.run_dir, "config.yaml"), "w") as f:
                    f.write(OmegaConf.to_yaml(raw, resolve=True))
        ctx = RunContext(job, topo, device, res.target_path, res.target_config, res.layer_ids, res.mask_token_id,
                         res.tokenizer, res.dtype, live=live, stop=stop, run_id=run_id, target_spec=res.spec)
        (run_target if topo.role == "target" else run_drafter)(ctx)
        live.done()
        stop.finished()  # a signal during the teardown has nothing left to stop: exit 0
    except Exception as e:  # noqa: BLE001 - exit now: destroy_process_group can block on a dead peer
        consequence = peer_error(e)
        if consequence:
            # A peer's death is often seen first as a closed connection: give the watcher the
            # time to name the rank at fault (it ends the process then). Past it, the peers' watchers
            # still name a dead or stuck rank before quoting this one (Liveness.check).
            live.settle()
        e = explain_oom(e, topo, job)
        live.failed(f"{topo.name(rank)} failed: {type(e).__name__}: {e}", consequence=consequence)
        rundir.fail(e, topo.role, rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


register()


@record
@hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # One console line per job, the traceback in the rank's log file.
    store = lambda: attempt_store(rank, world, datetime.timedelta(seconds=60))  # noqa: E731
    with rundir.fatal_errors(store, cfg.get("run_dir")):
        run(to_job(cfg), cfg)


if __name__ == "__main__":
    main()
    freeze_for_exit()
