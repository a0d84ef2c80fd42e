"""Hidden-state transport throughput for Qwen3-8B-sized batches (3072 x 5*4096 bf16, ~126 MB),
through the real transport (`build_transport`), against a plain device-to-device copy.

    torchrun --standalone --nproc-per-node 2 bench/ring.py --kind shm   # two ranks, one or two GPUs

GB/s counts payload bytes delivered per second (one batch = one slot). The copy baseline counts the
same payload once (it reads and writes it, like the ring's single copy into the slot).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import synthetic_batch, write_json  # noqa: E402
from dflash_mp.topology import Topology  # noqa: E402
from dflash_mp.main import pick_device  # noqa: E402
from dflash_mp.transport import SlotSpec, TransportConfig, build_transport, p2p_pairs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="shm")
    ap.add_argument("--targets", type=int, default=1, help="target ranks; every pair sends at once")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--hidden", type=int, default=5 * 4096)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    shared = cuda and world > torch.cuda.device_count()
    backend = "nccl" if cuda and not shared else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    cfg = TransportConfig(kind=a.kind, depth=a.depth)
    topo = dataclasses.replace(Topology.plan(a.targets, rank, world),
                               gpus_per_node=torch.cuda.device_count() if cuda else 0)
    topo.init_groups("auto" if cuda else "gloo", p2p_pairs=p2p_pairs(cfg, topo))  # as the trainer does
    topo.connect(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    spec = SlotSpec(a.seq_len, a.hidden, dtype, device)
    t = build_transport(cfg, topo, spec)
    hb = synthetic_batch(a.seq_len, a.hidden, 151936, device, dtype, seed=rank)
    warm = 10
    if topo.role == "target":
        for _ in range(warm + a.batches):
            for d in topo.feeds[rank]:
                t.send(d, hb)
        t.finish()
    else:
        src = topo.sources[rank][0]
        acc = torch.zeros((), device=device, dtype=torch.float32)
        for i in range(warm + a.batches):
            if i == warm:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            b = t.recv(src)
            acc += b.hidden[0, 0].float()  # consume it on the device, as a step would
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        t.expect_end(src)
        gb = spec.message_bytes * a.batches / 1e9
        # Baseline: the same payload through one plain device-to-device copy.
        src_t = torch.empty(spec.slot_bytes, dtype=torch.uint8, device=device)
        dst_t = torch.empty_like(src_t)
        for _ in range(5):
            dst_t.copy_(src_t)
        if cuda:
            torch.cuda.synchronize()
        c0 = time.perf_counter()
        for _ in range(50):
            dst_t.copy_(src_t)
        if cuda:
            torch.cuda.synchronize()
        copy_s = (time.perf_counter() - c0) / 50
        res = {"kind": a.kind, "world": world, "rank": rank, "pair": [src, rank], "device": torch.cuda.get_device_name() if cuda else "cpu",
               "batch_mb": spec.message_bytes / 1e6, "batches": a.batches, "ring_gb_per_s": gb / dt,
               "ring_ms_per_batch": 1000 * dt / a.batches, "copy_gb_per_s": spec.slot_bytes / 1e9 / copy_s,
               "copy_ms_per_batch": 1000 * copy_s}
        write_json(res, f"ring_{a.kind}_w{world}_r{rank}.json")
        print(f"\n{'transport':10} {'MB/batch':>9} {'ms/batch':>9} {'GB/s':>8} | copy {'ms':>6} {'GB/s':>8}")
        print(f"{a.kind + f' {src}->{rank}':10} {res['batch_mb']:9.1f} {res['ring_ms_per_batch']:9.3f} {res['ring_gb_per_s']:8.1f} | "
              f"     {res['copy_ms_per_batch']:6.3f} {res['copy_gb_per_s']:8.1f}", flush=True)
    t.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
