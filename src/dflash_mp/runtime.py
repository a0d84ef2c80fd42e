"""Start-up facts, derived once for every command (training, dump, reference, evaluate, plan):
logging, device and backend choice, the rendezvous store, and `prepare(job)`, the frozen record of
the target a job runs against.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from . import builtin, rundir
from .config import JobConfig
from .gpu_turns import check_mode as check_gpu_turns
from .resilience import restart_count
from .stages import plan_stages
from .target import TargetSpec, capture_layer_ids, check_model_path, load_target_config, mask_token_id, resolve_dtype
from .topology import Topology
from .trainer import build_drafter_args
from .transport import p2p_pairs

log = logging.getLogger("dflash_mp")


def setup_logging(rank: int, role: str, run_dir: str | None = None) -> None:
    """Console, plus `<run_dir>/logs/rank_<rank>.log` from the run directory's claim on (rundir)."""
    fmt = f"[%(asctime)s {role}{rank} %(levelname)s %(name)s] %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    rundir.buffer_rank_log(rank, {"T": "target", "D": "drafter"}.get(role, role), fmt, run_dir)


def pick_device(local_rank: int | None = None) -> torch.device:
    """This process's device, made current: GPU `local_rank` mod the GPU count (by default LOCAL_RANK,
    0 outside torchrun, so each process of a node takes its own); the CPU where there is no GPU."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
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


def resolve(job: JobConfig) -> JobConfig:
    """`job` with its `builtin:` names replaced by real paths (builtin.resolve), and the target path
    checked: the form every module below the entry points receives."""
    job = builtin.resolve(job)
    path = check_model_path(job.target.path, "target.path")
    return dataclasses.replace(job, target=dataclasses.replace(job.target, path=path))


def validate(job: JobConfig, target_config: dict, tokenizer, spec: TargetSpec | None = None) -> tuple[list[int], int]:
    """Cross-check drafter, data and target configs; returns (layer_ids, mask_token_id). `tokenizer`:
    anything with the tokenizer's length; `spec`: the target config already parsed."""
    spec = spec or TargetSpec.from_config(target_config)
    check_gpu_turns(job.topology.gpu_turns)
    layer_ids = capture_layer_ids(job.target, spec.num_layers)
    mask = mask_token_id(job.drafter.mask_token_id, len(tokenizer), spec.vocab_size)
    if job.data.seq_len < 2 * job.drafter.block_size:
        raise ValueError(f"data.seq_len={job.data.seq_len} is shorter than two blocks of "
                         f"drafter.block_size={job.drafter.block_size}: raise seq_len.")
    if job.drafter.num_anchors < 1:
        raise ValueError(f"drafter.num_anchors={job.drafter.num_anchors}: need at least 1.")
    try:
        build_drafter_args(job.drafter, spec, layer_ids, mask)
    except ValueError as e:  # the model's own checks name its fields: say where they are set
        raise ValueError(f"drafter config (drafter.*): {e}") from None
    plan_stages(target_config, layer_ids, job.target.stages, job.data.seq_len)  # a split that cannot be fails here
    rows = job.target.rows_per_forward
    if rows < 1 or (rows > 1 and job.target.stages > 1):
        raise ValueError(f"target.rows_per_forward={rows} with target.stages={job.target.stages}: use 1 or "
                         "more rows per forward, and more than 1 only with target.stages=1 (a later stage "
                         "takes the previous stage's rows one at a time)")
    return layer_ids, mask


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The target a job runs against, resolved and validated once (config and tokenizer, no weights)."""

    job: JobConfig  # the job with real paths (builtin names resolved); read this one, not the original
    target_path: str
    tokenizer: object
    target_config: dict
    spec: TargetSpec
    layer_ids: list[int]
    mask_token_id: int
    dtype: torch.dtype


def prepare(job: JobConfig, device: torch.device | None = None) -> Resolved:
    """Resolve and validate the target of `job`; `dtype` is `target.dtype` on `device` (CPU when None)."""
    from transformers import AutoTokenizer  # seconds to import: the process pays it only here

    job = resolve(job)
    path = job.target.path
    tokenizer = AutoTokenizer.from_pretrained(path)
    target_config = load_target_config(path)
    spec = TargetSpec.from_config(target_config)  # parsed here once; everything after reads Resolved.spec
    layer_ids, mask_id = validate(job, target_config, tokenizer, spec)
    dtype = resolve_dtype(job.target.dtype, device or torch.device("cpu"))
    return Resolved(job, path, tokenizer, target_config, spec, layer_ids, mask_id, dtype)
