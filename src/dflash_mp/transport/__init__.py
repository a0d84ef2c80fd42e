"""Hidden-state transport, target ranks -> drafter ranks: fixed-size slots, credit back-pressure.

    transport = build_transport(cfg, topology, spec)   # collective: every rank, same point
    # target                                  # drafter
    transport.send(dst, batch)                batch = transport.recv(src)
    transport.finish()                        transport.expect_end(src)
    transport.close()                         transport.close()

Each (target, drafter) pair gets its own channel: shared memory (`shm`) when both ranks are on one
node, NCCL/gloo point-to-point (`p2p`) otherwise; see the two modules for the protocols. A drafter-only
job (`topology.num_target_ranks=0`) reads features dumped by `dflash_mp.dump` instead (`files`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dflash_mp.topology import TARGET, Topology
from dflash_mp.transport.base import BaseReceiver, Receiver, Sender, SlotSpec
from dflash_mp.transport.p2p import P2PRecvChannel, P2PSendChannel
from dflash_mp.transport.shm import open_shm_channels, sweep_stale_segments

__all__ = [
    "TransportConfig", "SlotSpec", "Sender", "Receiver", "BaseReceiver",
    "build_transport", "link_kinds", "pair_kinds", "p2p_pairs", "sweep_stale_segments",
]

log = logging.getLogger(__name__)

KINDS = ("auto", "p2p", "shm", "files")


@dataclass
class TransportConfig:
    kind: str = "auto"  # p2p | shm | auto (shm for same-node pairs when possible, else p2p)
    depth: int = 2  # batches in flight per (target, drafter) pair (credits)
    timeout_s: float = 120.0  # a peer silent this long is an error naming the peer, never a hang
    shm_cuda: str = "auto"  # GPU shm slots: auto (CUDA IPC if the GPUs can peer, else pinned) | ipc | pinned
    files_dir: str = ""  # kind=files: the dump.dir of `python -m dflash_mp.dump` to train from


def pair_kinds(cfg: TransportConfig, topology: Topology) -> dict[tuple[int, int], str]:
    """(target, drafter) -> "shm" | "p2p" for every pair of the run; pure, the same on every rank."""
    if cfg.kind not in KINDS:
        raise ValueError(f"transport.kind={cfg.kind!r}: choose one of {', '.join(KINDS)}")
    if cfg.depth < 1:
        raise ValueError(f"transport.depth={cfg.depth}: at least 1 batch must be allowed in flight")
    if (cfg.kind == "files") != (not topology.target_ranks):
        raise ValueError(
            f"transport.kind={cfg.kind} with {len(topology.target_ranks)} target rank(s): a job that trains from "
            "dumped features sets transport.kind=files transport.files_dir=DIR topology.num_target_ranks=0; "
            "a streaming job needs at least one target rank and kind auto, p2p or shm."
        )
    kinds = {}
    for t, ds in sorted(topology.feeds.items()):
        for d in ds:
            local = topology.same_node(t, d)
            if cfg.kind == "p2p" and topology.gpus_per_node and topology.shares_gpu((t, d)):
                raise ValueError(
                    f"transport.kind=p2p, but target rank {t} and drafter rank {d} share GPU "
                    f"{topology.gpu_of(t)[1]}: NCCL cannot connect two ranks on one device; "
                    "use transport.kind=auto or shm"
                )
            if cfg.kind == "shm" and not local:
                raise ValueError(
                    f"transport.kind=shm, but target rank {t} and drafter rank {d} are on different nodes "
                    f"(ranks_per_node={topology.ranks_per_node}): use transport.kind=auto (shm where "
                    "possible, p2p elsewhere) or transport.kind=p2p"
                )
            kinds[(t, d)] = "shm" if local and cfg.kind != "p2p" else "p2p"
    return kinds


def link_kinds(cfg: TransportConfig, topology: Topology) -> dict[tuple[int, int], str]:
    """(stage s rank, stage s+1 rank) -> "shm" | "p2p" for every stage boundary of a staged target;
    chosen as for target->drafter pairs (a replica's stages always share a node)."""
    kinds = {}
    for t, u, _ in topology.stage_links:
        if cfg.kind == "p2p" and topology.gpus_per_node and topology.shares_gpu((t, u)):
            raise ValueError(
                f"transport.kind=p2p, but target stages {t} and {u} share GPU {topology.gpu_of(t)[1]}: NCCL "
                "cannot connect two ranks on one device; use transport.kind=auto or shm")
        kinds[(t, u)] = "p2p" if cfg.kind == "p2p" or not topology.same_node(t, u) else "shm"
    return kinds


def p2p_pairs(cfg: TransportConfig, topology: Topology) -> list[tuple[int, int]]:
    """The pairs that talk point-to-point (target->drafter pairs and stage links): `Topology.init_groups`
    gives each a group."""
    kinds = {**pair_kinds(cfg, topology), **link_kinds(cfg, topology)}
    return [p for p, k in sorted(kinds.items()) if k == "p2p"]


def build_transport(cfg: TransportConfig, topology: Topology, spec: SlotSpec, live=None,
                    link_spec=None) -> Sender | BaseReceiver:
    """This rank's end of the transport: a Sender on target ranks, a Receiver on drafter ranks.

    Staged targets (`topology.stages > 1`): `link_spec(boundary)` is the SlotSpec of the messages from
    stage `boundary` to the next; a non-last stage's Sender sends to its next stage, and a Sender of
    a stage after the first carries `upstream`, the Receiver of its previous stage's messages.

    Collective: call it on every rank at the same point, after `topology.init_groups()` (shm setup
    talks over `topology.control_group`) and, on CUDA, after `torch.cuda.set_device`. `live`: the
    rank's liveness watcher; it then bounds every wait instead of `cfg.timeout_s` alone (a peer that
    is busy compiling or loading is not a dead one).
    """
    kinds = pair_kinds(cfg, topology)
    if cfg.kind == "files":
        from dflash_mp.transport.files import FilesReceiver

        return FilesReceiver(cfg.files_dir, topology, spec, prefetch=cfg.depth)
    me = topology.rank
    links = link_kinds(cfg, topology)
    mine = [f"{t}->{d} {k}" for (t, d), k in sorted({**kinds, **links}.items()) if me in (t, d)]
    log.info("transport on rank %d (node %d): %s", me, topology.node_of(me), ", ".join(mine))
    channels: dict = {}
    upstream: dict = {}
    names = {r: topology.name(r) for r in range(topology.world_size)}
    try:
        shm_pairs = [p for p, k in kinds.items() if k == "shm"]
        if shm_pairs:
            shm = open_shm_channels(topology, spec, cfg.depth, cfg.timeout_s, shm_pairs, cfg.shm_cuda, names)
            for peer, ch in shm.items():
                ch.ring.live, ch.ring.peer_rank = live, peer
            channels.update(shm)
        for t, d in (p for p, k in sorted(kinds.items()) if k == "p2p"):
            # No pair group (tests that build groups by hand): the default group, as both ends agree.
            group = topology.pair_groups.get((t, d))
            if me == t:
                channels[d] = P2PSendChannel(me, d, spec, cfg.depth, cfg.timeout_s, group, live, names)
            elif me == d:
                channels[t] = P2PRecvChannel(me, t, spec, cfg.depth, cfg.timeout_s, group, live, names)
        _open_stage_links(cfg, topology, link_spec, live, channels, upstream)
    except BaseException:
        for ch in [*channels.values(), *upstream.values()]:
            ch.close()
        raise
    if topology.role != TARGET:
        return Receiver(channels)
    sender = Sender(channels)
    sender.upstream = Receiver(upstream) if upstream else None
    return sender


def _open_stage_links(cfg: TransportConfig, topology: Topology, link_spec, live, channels: dict,
                      upstream: dict) -> None:
    """Open this rank's stage-link channels: the one to its next stage into `channels`, the one from
    its previous stage into `upstream` (both keyed by peer rank). Collective like build_transport:
    every rank takes part in setting up each boundary's shm rings."""
    if topology.stages < 2:
        return
    kinds, me = link_kinds(cfg, topology), topology.rank
    names = {r: topology.name(r) for r in range(topology.world_size)}  # a stage's consumer is a target
    for boundary in range(topology.stages - 1):
        spec = link_spec(boundary)
        links = [(t, u) for t, u, b in topology.stage_links if b == boundary]
        shm_links = [p for p in links if kinds[p] == "shm"]
        if shm_links:
            opened = open_shm_channels(topology, spec, cfg.depth, cfg.timeout_s, shm_links, cfg.shm_cuda, names)
            for peer, ch in opened.items():
                ch.ring.live, ch.ring.peer_rank = live, peer
                (channels if peer == topology.next_stage(me) else upstream)[peer] = ch
        for t, u in (p for p in links if kinds[p] == "p2p"):
            group = topology.pair_groups.get((t, u))
            if me == t:
                channels[u] = P2PSendChannel(me, u, spec, cfg.depth, cfg.timeout_s, group, live, names)
            elif me == u:
                upstream[t] = P2PRecvChannel(me, t, spec, cfg.depth, cfg.timeout_s, group, live, names)
