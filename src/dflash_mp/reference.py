"""A one-process reference of a torchrun job: the same batches, seeds and optimizer steps, with
the target and every drafter replica in one process and no communication.

The process split must change nothing: per-step losses and final drafter weights of
`torchrun --nproc-per-node W` (gloo, fp32) equal this reference within float rounding.
`python -m dflash_mp.reference reference.world_size=3 train.max_steps=8` prints the per-step losses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from omegaconf import MISSING

from .cli import entry, tool_main
from .config import JobConfig
from .data import build_stream
from .model import DFlashDrafter
from .runtime import prepare
from .target import TargetWorker, load_target_head
from .topology import Topology
from .trainer import DFlashObjective, DrafterTrainer, build_drafter_args


def reference_run(job: JobConfig, world_size: int) -> dict:
    device, dtype = torch.device("cpu"), torch.float32
    # A staged target's replica computes what one unstaged target does: the reference runs it whole,
    # with one data shard per replica, fed to drafters by the replica's last stage.
    topo = Topology.plan(job.topology.num_target_ranks, 0, world_size, stages=job.target.stages)
    res = prepare(job)
    job, path, tokenizer, tcfg = res.job, res.target_path, res.tokenizer, res.target_config
    layer_ids, mask_id = res.layer_ids, res.mask_token_id
    streams = {rep[-1]: build_stream(job.data, tokenizer, i, topo.num_replicas, vocab_limit=tcfg["vocab_size"])
               for i, rep in enumerate(topo.replicas)}
    tc = job.train
    total = sum(s.batches_per_epoch(0) for s in streams.values())
    num_steps = tc.max_steps if tc.max_steps > 0 else int(tc.epochs * total // len(topo.drafter_ranks))
    worker = TargetWorker.load(path, layer_ids, device, dtype, job.target.attn_implementation,
                               packing_check=job.target.packing_check)

    args = build_drafter_args(job.drafter, tcfg, layer_ids, mask_id)
    torch.manual_seed(tc.seed)
    drafter = DFlashDrafter(args)
    embed, head = load_target_head(path, dtype, device)
    trainer = DrafterTrainer(DFlashObjective(drafter, args, embed, head, job.drafter), tc, num_steps, None, device)
    rng = {}
    for i, d in enumerate(topo.drafter_ranks):  # each drafter rank's own anchor RNG stream
        torch.manual_seed(tc.seed + 1 + i)
        rng[d] = torch.get_rng_state()

    its = {t: iter(s) for t, s in streams.items()}
    num_drafters = len(topo.drafter_ranks)
    losses = []
    for step in range(num_steps):
        batches = {}
        for t in streams:
            for d in topo.sends_at_step(t, step):
                # Clone outside inference mode, as a receive into a normal buffer would.
                batches[d] = worker.forward(next(its[t])).to("cpu", copy=True)
        trainer.set_lr()
        step_losses = []
        for d in topo.drafter_ranks:
            torch.set_rng_state(rng[d])
            step_losses.append(trainer.forward_backward(batches[d], grad_scale=1.0 / num_drafters).item())
            rng[d] = torch.get_rng_state()
        trainer.optimizer_step()
        losses.append(sum(step_losses) / num_drafters)
    return {"losses": losses, "state": {k: v.clone() for k, v in trainer.master_state_dict().items()},
            "num_steps": num_steps}


@dataclass
class ReferenceConfig:
    world_size: int = MISSING  # processes of the torchrun job to reproduce (its --nproc-per-node x nodes)


def reference_command(job: JobConfig, opts: ReferenceConfig) -> None:
    if opts.world_size < 2:
        raise ValueError(f"reference.world_size={opts.world_size}: a job has at least one target and one "
                         "drafter rank; use 2 or more.")
    out = reference_run(job, opts.world_size)
    print(json.dumps({"losses": out["losses"]}))


def main(argv: list[str] | None = None) -> None:
    tool_main("reference", ReferenceConfig, reference_command, __doc__, argv)


if __name__ == "__main__":
    entry(main)
