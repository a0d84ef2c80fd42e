"""Entry point for every rank: `torchrun --nproc-per-node N -m dflash_mp.main [hydra overrides]`.

Compose config -> validate (before any process group or model) -> init distributed -> build the
topology's groups -> run this rank's role -> always tear down.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
import time

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from . import checkpoint as ckpt
from . import rundir
from .config import CONF_DIR, JobConfig, register, to_job
from .liveness import Liveness, peer_error
from .metrics import quiet_console
from .resilience import StopSignal, effective_resume, restart_count
from .topology import Topology
from .transport import p2p_pairs

log = logging.getLogger("dflash_mp")


def setup_logging(rank: int, role: str, run_dir: str | None = None) -> None:
    """Console, plus `<run_dir>/logs/rank_<rank>.log` from the run directory's claim on (rundir)."""
    fmt = f"[%(asctime)s {role}{rank} %(levelname)s %(name)s] %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    rundir.buffer_rank_log(rank, {"T": "target", "D": "drafter"}.get(role, role), fmt, run_dir)


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def resolve_backend(name: str, device: torch.device, local_world: int, transport_kind: str = "auto") -> str:
    """The default group's backend: nccl when every rank owns a GPU; gloo on CPU and when ranks
    share GPUs (NCCL cannot pair two ranks on one device: such runs move hidden states over the shm
    ring). Each group then gets the fastest backend its own members allow (`Topology.backend_for`)."""
    shared = device.type == "cuda" and local_world > torch.cuda.device_count()
    if shared and transport_kind == "p2p":
        raise ValueError(f"transport.kind=p2p with {local_world} ranks on {torch.cuda.device_count()} GPU(s): "
                         "ranks that share a GPU can only exchange hidden states over the shm ring; "
                         "use transport.kind=auto or shm.")
    if name == "auto":
        if shared:
            log.info("%d ranks share %d GPU(s): shm transport; NCCL only for groups whose members own "
                     "distinct GPUs", local_world, torch.cuda.device_count())
        return "nccl" if device.type == "cuda" and not shared else "gloo"
    if name == "nccl" and shared:
        raise ValueError(f"topology.backend=nccl with {local_world} ranks on {torch.cuda.device_count()} GPU(s): "
                         "NCCL cannot pair two ranks on one device; use topology.backend=auto.")
    return name


def validate(job: JobConfig, target_config: dict, tokenizer) -> tuple[list[int], int]:
    """Cross-check drafter, data and target configs; returns (layer_ids, mask_token_id)."""
    from .target import default_layer_ids
    from .trainer import build_drafter_args

    num_layers = target_config["num_hidden_layers"]
    layer_ids = list(job.target.layer_ids) if job.target.layer_ids else default_layer_ids(num_layers, job.target.num_capture)
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad or len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"target.layer_ids={layer_ids}: ids must be distinct and in 0..{num_layers - 1} "
                         f"for a target with {num_layers} layers.")
    layer_ids = sorted(layer_ids)
    vocab = target_config["vocab_size"]
    mask = job.drafter.mask_token_id
    if mask is None:
        mask = len(tokenizer)
        if mask >= vocab:
            raise ValueError(f"the target's embedding has no spare row past its tokenizer (len {len(tokenizer)}, "
                             f"vocab_size {vocab}): set drafter.mask_token_id to an id the data never uses.")
    elif not 0 <= mask < vocab:
        raise ValueError(f"drafter.mask_token_id={mask} is outside the target vocabulary 0..{vocab - 1}.")
    if job.data.seq_len < 2 * job.drafter.block_size:
        raise ValueError(f"data.seq_len={job.data.seq_len} is shorter than two blocks of "
                         f"drafter.block_size={job.drafter.block_size}: raise seq_len.")
    if job.drafter.num_anchors < 1:
        raise ValueError(f"drafter.num_anchors={job.drafter.num_anchors}: need at least 1.")
    try:
        build_drafter_args(job.drafter, target_config, layer_ids, mask)
    except ValueError as e:  # the model's own checks name its fields: say where they are set
        raise ValueError(f"drafter config (drafter.*): {e}") from None
    return layer_ids, mask


def prepare(job: JobConfig):
    """Resolve and validate the target (config and tokenizer only, no weights)."""
    from transformers import AutoTokenizer

    from .target import load_target_config, resolve_path

    target_path = resolve_path(job.target)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target_config = load_target_config(target_path)
    layer_ids, mask_id = validate(job, target_config, tokenizer)
    return target_path, tokenizer, target_config, layer_ids, mask_id


def attempt_store(rank: int, world: int, timeout: datetime.timedelta):
    """The env:// store, under a prefix per torchrun attempt: a restarted worker group may get the
    agent's store back with the previous attempt's keys in it (gloo would connect to dead ranks)."""
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", rank, world, timeout=timeout))
    return dist.PrefixStore(f"dflash_attempt_{restart_count()}", store)


def watcher_store(timeout: datetime.timedelta):
    """A connection of the liveness watcher's own to the same store (a client, never the server):
    a main thread blocked in a store wait must not hold up the heartbeats."""
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"dflash_live_{restart_count()}", client)


def init_distributed(job: JobConfig, topo: Topology, device: torch.device, backend: str, live,
                     store=None, timeout: datetime.timedelta | None = None) -> None:
    """Default group, every process group of the topology, and their NCCL communicators.

    The default group is never bound to a device (`device_id`): see `Topology.init_groups`."""
    rank, world = topo.rank, topo.world_size
    if timeout is None:
        timeout = datetime.timedelta(seconds=job.topology.timeout_s or (1800.0 if device.type == "cuda" else 120.0))
    live.phase("starting", "init_process_group")
    dist.init_process_group(backend=backend, store=store or attempt_store(rank, world, timeout), rank=rank,
                            world_size=world, timeout=timeout)
    groups = "auto" if job.topology.backend == "auto" and device.type == "cuda" else backend
    t0 = time.monotonic()
    topo.init_groups(groups, timeout, p2p_pairs(job.transport, topo), on_group=lambda d: live.phase("starting", d))
    topo.connect(device, on_group=lambda d: live.phase("starting", d))
    log.info("process groups and communicators ready in %.1f s", time.monotonic() - t0)


def run(job: JobConfig, raw: DictConfig | None = None) -> None:
    from .roles import RunContext, run_drafter, run_target
    from .target import resolve_dtype

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    from .plan import resolve_num_target_ranks

    topo = Topology.plan(resolve_num_target_ranks(job, world), rank, world, local_world,
                         allow_no_target=job.transport.kind == "files")
    setup_logging(rank, "T" if topo.role == "target" else "D", job.run_dir)
    quiet_console(rank == topo.drafter_ranks[0])  # one set of progress bars per job, before any model loads
    stop = StopSignal(job.train.stop_grace_s).install()  # before anything slow: Slurm may signal early
    device = pick_device(local_rank)
    timeout_s = job.topology.timeout_s or (1800.0 if device.type == "cuda" else 120.0)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = attempt_store(rank, world, timeout)
    rundir.use_store(store)  # the run dir's claim and the one console line per fatal error agree through it
    backend = resolve_backend(job.topology.backend, device, local_world, job.transport.kind)
    topo = dataclasses.replace(topo, gpus_per_node=torch.cuda.device_count() if device.type == "cuda" else 0)
    p2p_pairs(job.transport, topo)  # a transport the placement cannot carry fails before any group

    target_path, tokenizer, target_config, layer_ids, mask_id = prepare(job)
    dtype = resolve_dtype(job.target.dtype, device)
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
    try:
        init_distributed(job, topo, device, backend, live, store, timeout)
        if rank == 0:
            log.info("topology: %s; backend %s; layers %s; mask token %d", topo.describe(), backend, layer_ids, mask_id)
            os.makedirs(job.run_dir, exist_ok=True)
            if raw is not None:
                with open(os.path.join(job.run_dir, "config.yaml"), "w") as f:
                    f.write(OmegaConf.to_yaml(raw, resolve=True))
        ctx = RunContext(job, topo, device, target_path, target_config, layer_ids, mask_id, tokenizer, dtype,
                         live=live, stop=stop, run_id=run_id)
        (run_target if topo.role == "target" else run_drafter)(ctx)
        live.done()
    except Exception as e:  # noqa: BLE001 - exit now: destroy_process_group can block on a dead peer
        if peer_error(e):
            # A peer's death is often seen first as a closed connection: give the watcher the
            # time to name the rank at fault (it ends the process then).
            live.settle()
        live.failed(f"{topo.name(rank)} failed: {type(e).__name__}: {e}")
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
