"""Offline features: run only the target and write its captured hidden states to disk.

    python -m dflash_mp.dump <the overrides of the training job> dump.dir=/data/feats [dump.batches_per_shard=8]
    torchrun --nproc-per-node 8 -m dflash_mp.dump ... dump.dir=/data/feats     # every rank a target

Each dump rank reads its own data shard (the same shards a streaming job's target ranks read) for
one epoch and writes `r{rank}-{shard}.safetensors` files of `batches_per_shard` stacked batches
(layout in `transport/files.py`), then rank 0 writes `manifest.json`. Rerunning the same command
resumes: complete shard files are skipped without running the target, and a shard is written to a
temporary name and renamed, so a crash never leaves a truncated shard behind. Train from the dump:

    torchrun --nproc-per-node 2 -m dflash_mp.main <same overrides> topology.num_target_ranks=0 \\
        transport.kind=files transport.files_dir=/data/feats
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .batch import TOKEN_FIELDS
from .cli import entry, tool_main
from .data import build_stream
from .roles import seek
from .runtime import pick_device, prepare, setup_logging
from . import process_options
from .target import TargetWorker
from .transport.files import MANIFEST, MANIFEST_VERSION

log = logging.getLogger("dflash_mp.dump")


@dataclass
class DumpConfig:
    dir: str = ""  # output directory (shards + manifest.json)
    batches_per_shard: int = 8  # packed batches per safetensors file (held in host memory until written)
    max_batches: int = 0  # per dump rank; 0 = one full epoch of its data shard


def shard_name(rank: int, index: int) -> str:
    return f"r{rank:03d}-{index:05d}.safetensors"


def bytes_per_token(hidden_dim: int, dtype: torch.dtype) -> int:
    """Bytes stored per token: the captured hidden row plus the four int64 token fields."""
    return hidden_dim * dtype.itemsize + 8 * len(TOKEN_FIELDS)


def shard_plan(num_batches: int, per_shard: int) -> list[tuple[int, int]]:
    """(first batch, number of batches) of each shard of one rank."""
    return [(s, min(per_shard, num_batches - s)) for s in range(0, num_batches, per_shard)]


def check_disk(path: str, need_bytes: int) -> bool:
    """Warn (and return False) when `need_bytes` exceeds the free space at `path`."""
    free = shutil.disk_usage(path).free
    if need_bytes > free:
        log.warning("the dump needs about %.2f GiB more but only %.2f GiB are free at %s: it will fail part "
                    "way (rerun after freeing space resumes it)", need_bytes / 2**30, free / 2**30, path)
        return False
    return True


def write_shard(path: str, batches: list, dtype: torch.dtype, meta: dict) -> None:
    """Stack `batches` (HiddenBatch) into one safetensors file, atomically."""
    from safetensors.torch import save_file

    tensors = {"hidden": torch.stack([b.hidden.to("cpu", dtype) for b in batches])}
    for name in TOKEN_FIELDS:
        tensors[name] = torch.stack([getattr(b, name).to("cpu", torch.int64) for b in batches])
    tensors["num_valid_tokens"] = torch.tensor([b.num_valid_tokens for b in batches], dtype=torch.int64)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={k: str(v) for k, v in meta.items()})
    os.replace(tmp, path)


def _atomic_json(obj: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def check_options(cfg: DumpConfig) -> None:
    if not cfg.dir:
        raise ValueError("set dump.dir=DIR: where the shards and manifest.json go.")
    if cfg.batches_per_shard < 1:
        raise ValueError(f"dump.batches_per_shard={cfg.batches_per_shard}: use 1 or more.")


def run_dump(job, cfg: DumpConfig) -> dict | None:
    """Dump this rank's shard; rank 0 returns the manifest (others None)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    setup_logging(rank, "T")
    device = pick_device()  # under torchrun, one GPU per process
    res = prepare(job, device)
    target_path, tokenizer, tcfg, layer_ids, mask_id, dtype = (res.target_path, res.tokenizer, res.target_config,
                                                               res.layer_ids, res.mask_token_id, res.dtype)
    os.makedirs(cfg.dir, exist_ok=True)
    group = world > 1
    if group:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(hours=4))
    try:
        stream = build_stream(res.job.data, tokenizer, rank, world, vocab_limit=tcfg["vocab_size"])
        num = stream.batches_per_epoch(0)
        if cfg.max_batches:
            num = min(num, cfg.max_batches)
        hidden_dim = len(layer_ids) * tcfg["hidden_size"]
        bpt = bytes_per_token(hidden_dim, dtype)
        plan = shard_plan(num, cfg.batches_per_shard)
        todo = [i for i in range(len(plan)) if not os.path.exists(os.path.join(cfg.dir, shard_name(rank, i)))]
        need = sum(plan[i][1] for i in todo) * job.data.seq_len * bpt
        needs = [need] * world
        if group:
            dist.all_gather_object(needs, need)
        if rank == 0:
            log.info("dump: %d rank(s), %d bytes per token (%d hidden + %d token fields), %.3f GiB to write",
                     world, bpt, hidden_dim * dtype.itemsize, 8 * len(TOKEN_FIELDS), sum(needs) / 2**30)
            check_disk(cfg.dir, sum(needs))
        log.info("rank %d: %d batches in %d shards, %d already complete", rank, num, len(plan), len(plan) - len(todo))
        if todo:
            per = job.target.rows_per_forward
            process_options.apply(job.target, device, "target")  # before any GEMM and compile
            worker = TargetWorker.load(target_path, layer_ids, device, dtype, job.target.attn_implementation,
                                       job.target.compile, job.target.packing_check,
                                       probe_len=job.data.seq_len * per, cuda_graph=job.target.cuda_graph,
                                       fold_norms=job.target.fold_norms)
            for i in todo:
                first, n = plan[i]
                seek(stream, first)
                it = iter(stream)
                batches = worker.forward_many([next(it) for _ in range(n)], per)
                write_shard(os.path.join(cfg.dir, shard_name(rank, i)), batches, dtype,
                            {"rank": rank, "index": i, "first_batch": first, "num_batches": n})
                log.info("rank %d: wrote shard %d/%d", rank, i + 1, len(plan))
        shards = [{"file": shard_name(rank, i), "rank": rank, "index": i, "num_batches": n}
                  for i, (_, n) in enumerate(plan)]
        gathered = [shards] * world
        if group:
            dist.all_gather_object(gathered, shards)
        if rank != 0:
            return None
        all_shards = [s for part in gathered for s in part]
        manifest = {
            "version": MANIFEST_VERSION,
            "seq_len": job.data.seq_len,
            "hidden_dim": hidden_dim,
            "hidden_size": tcfg["hidden_size"],
            "hidden_dtype": str(dtype).removeprefix("torch."),
            "layer_ids": layer_ids,
            "mask_token_id": mask_id,
            "target_path": job.target.path,
            "resolved_target_path": target_path,
            "target": dataclasses.asdict(job.target),
            "data": dataclasses.asdict(job.data),
            "num_ranks": world,
            "num_batches": sum(s["num_batches"] for s in all_shards),
            "bytes_per_token": bpt,
            "shards": all_shards,
        }
        _atomic_json(manifest, os.path.join(cfg.dir, MANIFEST))
        log.info("dump complete: %d batches, %d bytes per token -> %s", manifest["num_batches"], bpt, cfg.dir)
        return manifest
    finally:
        if group:
            dist.destroy_process_group()


def dump_command(job, cfg: DumpConfig) -> None:
    check_options(cfg)
    run_dump(job, cfg)


def main(argv: list[str] | None = None) -> None:
    tool_main("dump", DumpConfig, dump_command, __doc__, argv)


if __name__ == "__main__":
    entry(main)
