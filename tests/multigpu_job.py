"""Start-up of the real entry point's distributed layer on GPUs, without a model: every group,
every NCCL communicator, the transport, a few batches and a drafter all-reduce. Run under torchrun:

    torchrun --nproc-per-node N tests/multigpu_job.py <num_target_ranks> <transport.kind>

Prints one line per rank, "ok <rank> <group backends>", and exits 0; a hang is the caller's timeout.
"""

import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist

from dflash_mp.batch import HiddenBatch
from dflash_mp.config import compose
from dflash_mp.liveness import Liveness
from dflash_mp.runtime import init_distributed, pick_device, resolve_backend, watcher_store
from dflash_mp.topology import Topology
from dflash_mp.transport import SlotSpec, build_transport

STEPS = 6


def main() -> None:
    num_targets, kind = int(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    job = compose([f"topology.num_target_ranks={num_targets}", f"transport.kind={kind}", "transport.timeout_s=30"])
    device = pick_device(local_rank)
    backend = resolve_backend("auto", device, local_world, kind)
    topo = Topology.plan(num_targets, rank, world, local_world)
    topo = dataclasses.replace(topo, gpus_per_node=torch.cuda.device_count() if device.type == "cuda" else 0)
    names = {r: topo.name(r) for r in range(world)}
    live = Liveness(watcher_store(datetime.timedelta(seconds=30)), rank, world, names, job.liveness, 30.0).start()
    init_distributed(job, topo, device, backend, live)
    live.phase("training")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = SlotSpec(seq_len=64, hidden_dim=256, hidden_dtype=dtype, device=device)
    ep = build_transport(job.transport, topo, spec, live)
    with ep:
        if topo.role == "target":
            for step in range(STEPS):
                for d in topo.sends_at_step(rank, step):
                    t = torch.arange(64, device=device) + step
                    hb = HiddenBatch(torch.full((64, 256), float(step), device=device, dtype=dtype),
                                     input_ids=t, position_ids=t, doc_ids=torch.zeros_like(t), loss_mask=t % 2,
                                     seq=step, num_valid_tokens=64)
                    ep.send(d, hb)
            ep.finish()
        else:
            total = torch.zeros(1, device=device)
            for step in range(STEPS):
                hb = ep.recv(topo.source_for_step(rank, step))
                assert float(hb.hidden[0, 0]) == float(hb.input_ids[0]), (step, float(hb.hidden[0, 0]))
                total += hb.hidden.float().mean()
                dist.all_reduce(total, group=topo.drafter_group)
            for src in topo.sources[rank]:
                ep.expect_end(src)
            ep.verify()
    if device.type == "cuda":
        torch.cuda.synchronize()
    live.done()
    print(f"ok {rank} {topo.backends}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
