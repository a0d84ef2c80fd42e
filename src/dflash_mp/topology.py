"""Who does what: the rank -> role map, target/drafter pairings, and every process group.

`Topology` is a value object. `Topology.plan(...)` is pure (no torch.distributed), so a bad split
fails with a `ValueError` before any process group or model exists; `init_groups()` then builds
every group on every rank in the same order (`new_group` is collective over the whole world).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

TARGET = "target"
DRAFTER = "drafter"
FILES_SOURCE = -1  # the "source rank" of a drafter-only job: batches come from dumped files


@dataclass
class TopologyConfig:
    # Ranks running the frozen target; the rest train the drafter. "auto" = the best whole-GPU split
    # of the planner's FLOP estimate (`python -m dflash_mp.plan`); 0 only with transport.kind=files.
    num_target_ranks: int | str = 1
    # torch.distributed backend: auto (on CUDA, nccl for every group whose members own distinct GPUs,
    # gloo where two members share one; gloo on CPU) | nccl | gloo (everywhere)
    backend: str = "auto"
    # Process-group timeout (collectives, NCCL watchdog). 0 = auto: 120 s on CPU; 1800 s on CUDA,
    # where a drafter's first compiled step keeps posted receives waiting for minutes. Dead peers
    # are caught sooner by transport.timeout_s, which bounds every wait for data or credit.
    timeout_s: float = 0.0
    # Ranks that share one GPU: they take turns at it, each finishing a target forward or a drafter step
    # before the other's starts, so the GPU never switches between them mid-work (gpu_turns.py). auto =
    # on CUDA when the job has one drafter (1 target + 1 drafter on one H200) | on (also with drafters on
    # several shared GPUs; never two drafters on one GPU) | off.
    gpu_turns: str = "auto"


def _pair(targets: list[int], drafters: list[int]) -> dict[int, list[int]]:
    """Round-robin pairing inside one pool: every rank gets at least one partner."""
    feeds: dict[int, list[int]] = {t: [] for t in targets}
    if len(drafters) >= len(targets):
        for j, d in enumerate(drafters):
            feeds[targets[j % len(targets)]].append(d)
    else:
        for i, t in enumerate(targets):
            feeds[t].append(drafters[i % len(drafters)])
    return feeds


@dataclass
class Topology:
    rank: int
    world_size: int
    ranks_per_node: int
    target_ranks: tuple[int, ...]
    drafter_ranks: tuple[int, ...]
    feeds: dict[int, tuple[int, ...]]  # feeding target rank (a replica's last stage) -> drafter ranks (sorted)
    sources: dict[int, tuple[int, ...]]  # drafter rank -> target ranks it receives from (sorted)
    # Target replicas, each its ranks in stage order (one rank each with target.stages=1). Empty: one
    # replica per target rank (Topology built by hand).
    replicas: tuple[tuple[int, ...], ...] = ()
    target_group: object = field(default=None, repr=False)
    drafter_group: object = field(default=None, repr=False)
    control_group: object = field(default=None, repr=False)  # gloo, whole world: metadata, liveness
    drafter_cpu_group: object = field(default=None, repr=False)  # gloo, drafters: checkpoint barriers
    pair_groups: dict = field(default_factory=dict, repr=False)  # (target, drafter) -> group of a p2p pair
    gpus_per_node: int = 0  # 0: CPU ranks; else rank r runs on GPU (r % ranks_per_node) % gpus_per_node
    backends: dict = field(default_factory=dict)  # group name -> backend it was built with

    def __post_init__(self):
        if not self.replicas:
            self.replicas = tuple((t,) for t in self.target_ranks)

    # ---------------------------------------------------------------- planning (pure)
    @classmethod
    def plan(cls, num_target_ranks: int, rank: int, world_size: int, ranks_per_node: int | None = None,
             allow_no_target: bool = False, stages: int = 1):
        """`allow_no_target`: a drafter-only job (every rank trains, batches come from files) may set
        num_target_ranks=0; then even one process is a valid job. `stages`: ranks per target replica
        (`target.stages`); a replica's ranks are consecutive and on one node, its last stage feeds drafters."""
        if allow_no_target and num_target_ranks == 0:
            return cls._drafters_only(rank, world_size, ranks_per_node)
        if world_size < 2:
            raise ValueError(
                f"world_size={world_size}: dflash_mp needs at least 2 ranks (one target, one drafter); "
                "launch with `torchrun --nproc-per-node 2` or more."
            )
        if stages < 1:
            raise ValueError(f"target.stages={stages}: use 1 (the whole target on one rank) or more.")
        if world_size < stages + 1:
            raise ValueError(
                f"target.stages={stages} needs at least {stages + 1} ranks (one target replica of {stages} stages "
                f"and a drafter), but world_size={world_size}: launch more processes or lower target.stages.")
        if not 1 <= num_target_ranks <= world_size - 1:
            hint = (" (0 is legal only for a drafter-only job reading dumped features: transport.kind=files)"
                    if num_target_ranks == 0 else "")
            if stages > 1:
                hint += f" and a multiple of target.stages={stages}"
            raise ValueError(
                f"topology.num_target_ranks={num_target_ranks} is impossible with world_size={world_size}: "
                f"choose a value from 1 to {world_size - 1} so that both roles have at least one rank{hint}."
            )
        rpn = ranks_per_node or world_size
        if world_size % rpn:
            raise ValueError(f"world_size={world_size} is not a multiple of ranks_per_node={rpn}.")
        num_nodes = world_size // rpn
        if num_target_ranks % stages:
            raise ValueError(
                f"topology.num_target_ranks={num_target_ranks} is not a multiple of target.stages={stages}: each "
                f"target replica is {stages} ranks; use num_target_ranks={stages * max(1, num_target_ranks // stages)} "
                f"(or another multiple of {stages}).")
        num_replicas = num_target_ranks // stages
        # Spread replicas evenly over nodes (first ranks of each node) so pairs and stages stay node-local.
        reps = [num_replicas // num_nodes + (n < num_replicas % num_nodes) for n in range(num_nodes)]
        if max(reps) * stages > rpn:
            raise ValueError(
                f"target.stages={stages} with topology.num_target_ranks={num_target_ranks}: node(s) of "
                f"{rpn} ranks would hold {max(reps)} replica(s) of {stages} stages, and a replica's stages must "
                f"share one node; use fewer target ranks, fewer stages, or more ranks per node.")
        per_node = [k * stages for k in reps]
        targets, drafters, replicas = [], [], []
        for node, k in enumerate(per_node):
            node_ranks = list(range(node * rpn, (node + 1) * rpn))
            targets += node_ranks[:k]
            drafters += node_ranks[k:]
            replicas += [tuple(node_ranks[i:i + stages]) for i in range(0, k, stages)]
        feeders = [rep[-1] for rep in replicas]
        node_local = all(0 < k < rpn for k in per_node)
        feeds: dict[int, list[int]] = {}
        if node_local:
            for node in range(num_nodes):
                lo, hi = node * rpn, (node + 1) * rpn
                feeds.update(_pair([t for t in feeders if lo <= t < hi], [d for d in drafters if lo <= d < hi]))
        else:
            feeds = _pair(feeders, drafters)
        sources: dict[int, list[int]] = {d: [] for d in drafters}
        for t, ds in feeds.items():
            for d in ds:
                sources[d].append(t)
        return cls(
            rank=rank,
            world_size=world_size,
            ranks_per_node=rpn,
            target_ranks=tuple(targets),
            drafter_ranks=tuple(drafters),
            feeds={t: tuple(sorted(ds)) for t, ds in feeds.items()},
            sources={d: tuple(sorted(ts)) for d, ts in sources.items()},
            replicas=tuple(replicas),
        )

    @classmethod
    def _drafters_only(cls, rank: int, world_size: int, ranks_per_node: int | None):
        rpn = ranks_per_node or world_size
        if world_size < 1 or world_size % rpn:
            raise ValueError(f"world_size={world_size} is not a multiple of ranks_per_node={rpn}.")
        drafters = tuple(range(world_size))
        return cls(rank=rank, world_size=world_size, ranks_per_node=rpn, target_ranks=(),
                   drafter_ranks=drafters, feeds={}, sources={d: () for d in drafters})

    # ---------------------------------------------------------------- groups (collective)
    def gpu_of(self, rank: int) -> tuple[int, int] | None:
        """(node, GPU index) of `rank` (what `pick_device` chooses from LOCAL_RANK), None on CPU."""
        if not self.gpus_per_node:
            return None
        return self.node_of(rank), (rank % self.ranks_per_node) % self.gpus_per_node

    def shares_gpu(self, ranks) -> bool:
        gpus = [self.gpu_of(r) for r in ranks]
        return None in gpus or len(set(gpus)) < len(gpus)

    def backend_for(self, ranks, backend: str) -> str:
        """`backend` auto: nccl when every member owns a GPU of its own, else gloo (NCCL cannot put
        two ranks of one communicator on one device)."""
        if backend != "auto":
            return backend
        return "gloo" if self.shares_gpu(ranks) else "nccl"

    def init_groups(self, backend: str, timeout=None, p2p_pairs=(), on_group=None) -> "Topology":
        """Build every group on every rank in one fixed order; call once after init_process_group.

        NCCL communicators are created lazily (the default group is not bound to a device): an
        eagerly bound default group makes `new_group` split its communicator, a collective of the
        whole world that non-members join too, and on torch 2.11 the split deadlocks against gloo
        group creation. `connect()` then creates each NCCL communicator among its members only.
        Each p2p (target, drafter) pair gets a group of its own, so its traffic neither queues
        behind collectives nor behind another pair's transfers. `on_group(name)` is told each step.
        """
        kw = {"timeout": timeout} if timeout is not None else {}

        def new(name: str, ranks, be: str):
            if on_group is not None:
                on_group(f"new_group {name} ({be})")
            self.backends[name] = be
            return dist.new_group(list(ranks), backend=be, **kw)

        # No target group in a drafter-only job (the same on every rank, so the order still agrees).
        if self.target_ranks:
            self.target_group = new("targets", self.target_ranks, self.backend_for(self.target_ranks, backend))
        self.drafter_group = new("drafters", self.drafter_ranks, self.backend_for(self.drafter_ranks, backend))
        self.control_group = new("control", range(self.world_size), "gloo")
        self.drafter_cpu_group = new("drafters_cpu", self.drafter_ranks, "gloo")
        for t, d in sorted(p2p_pairs):
            self.pair_groups[(t, d)] = new(f"pair {t}->{d}", (t, d), self.backend_for((t, d), backend))
        return self

    def connect(self, device, on_group=None) -> None:
        """Create every NCCL communicator this rank belongs to now, at start-up, not mid-run (a first
        collective blocks until all members arrive). Role groups first (disjoint members), then the
        pairs in one global order, which no two ranks can wait on in opposite orders."""
        import torch

        if device.type != "cuda":
            return
        x = torch.zeros(1, device=device)
        for name, group, ranks in (("targets", self.target_group, self.target_ranks),
                                   ("drafters", self.drafter_group, self.drafter_ranks)):
            if self.rank in ranks and self.backends.get(name) == "nccl":
                if on_group is not None:
                    on_group(f"connect {name}")
                dist.all_reduce(x, group=group)
        for (t, d), group in sorted(self.pair_groups.items()):
            if self.rank in (t, d) and dist.get_backend(group) == "nccl":
                if on_group is not None:
                    on_group(f"connect pair {t}->{d}")
                op = dist.isend if self.rank == t else dist.irecv
                for w in dist.batch_isend_irecv([dist.P2POp(op, x, d if self.rank == t else t, group=group)]):
                    w.wait()
        torch.cuda.synchronize(device)

    # ---------------------------------------------------------------- queries
    @property
    def role(self) -> str:
        return TARGET if self.rank in self.target_ranks else DRAFTER

    @property
    def role_rank(self) -> int:
        """Index of this rank among the ranks of its role."""
        ranks = self.target_ranks if self.role == TARGET else self.drafter_ranks
        return ranks.index(self.rank)

    @property
    def role_size(self) -> int:
        return len(self.target_ranks) if self.role == TARGET else len(self.drafter_ranks)

    @property
    def is_role_leader(self) -> bool:
        return self.role_rank == 0

    @property
    def role_group(self):
        return self.target_group if self.role == TARGET else self.drafter_group

    # ---------------------------------------------------------------- stages of a target replica
    @property
    def stages(self) -> int:
        return len(self.replicas[0]) if self.replicas else 1

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def replica_of(self, rank: int) -> tuple[int, ...]:
        """The ranks of `rank`'s target replica, in stage order."""
        for rep in self.replicas:
            if rank in rep:
                return rep
        raise ValueError(f"rank {rank} is not a target rank (targets: {list(self.target_ranks)})")

    def replica_index(self, rank: int) -> int:
        """Which replica `rank` belongs to: its data shard."""
        return self.replicas.index(self.replica_of(rank))

    def stage_of(self, rank: int) -> int:
        return self.replica_of(rank).index(rank)

    def feeder_of(self, rank: int) -> int:
        """The last stage of `rank`'s replica: the rank that sends its batches to drafters."""
        return self.replica_of(rank)[-1]

    def prev_stage(self, rank: int) -> int | None:
        rep = self.replica_of(rank)
        i = rep.index(rank)
        return rep[i - 1] if i else None

    def next_stage(self, rank: int) -> int | None:
        rep = self.replica_of(rank)
        i = rep.index(rank)
        return rep[i + 1] if i + 1 < len(rep) else None

    @property
    def stage_links(self) -> list[tuple[int, int, int]]:
        """(producer, consumer, boundary) for every stage boundary of every replica: boundary s joins
        stage s to stage s + 1."""
        return [(rep[s], rep[s + 1], s) for rep in self.replicas for s in range(len(rep) - 1)]

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def source_for_step(self, drafter: int, step: int) -> int:
        """The target rank whose batch `drafter` consumes at drafter step `step` (round robin);
        FILES_SOURCE in a drafter-only job."""
        src = self.sources[drafter]
        if not src:
            return FILES_SOURCE
        return src[step % len(src)]

    def sends_at_step(self, target: int, step: int) -> list[int]:
        """Drafter ranks that `target`'s replica sends one batch to for drafter step `step`, in send
        order (every stage of a replica forwards the same batches, in this order)."""
        target = self.feeder_of(target)
        return [d for d in self.feeds[target] if self.source_for_step(d, step) == target]

    def num_sends(self, target: int, num_steps: int) -> int:
        """Batches `target`'s replica produces for drafter steps [0, num_steps)."""
        target = self.feeder_of(target)
        total = 0
        for d in self.feeds[target]:
            src = self.sources[d]
            i = src.index(target)
            total += len(range(i, num_steps, len(src)))
        return total

    def describe(self) -> str:
        pairs = ", ".join(f"{t}->{list(ds)}" for t, ds in sorted(self.feeds.items()))
        if self.stages > 1:
            reps = ", ".join("->".join(map(str, rep)) for rep in self.replicas)
            pairs = f"{self.num_replicas} replica(s) x {self.stages} stages: {reps}; " + pairs
        groups = ", ".join(f"{k} {v}" for k, v in self.backends.items() if not k.startswith("pair"))
        return (
            f"world={self.world_size} targets={list(self.target_ranks)} drafters={list(self.drafter_ranks)} "
            f"pairs: {pairs}" + (f"; groups: {groups}" if groups else "")
        )

    def name(self, rank: int) -> str:
        """How messages name a rank: "target rank 0", "drafter rank 3", "target rank 1 (stage 1 of 2)"."""
        if rank in self.target_ranks and self.stages > 1:
            return f"{TARGET} rank {rank} (stage {self.stage_of(rank)} of {self.stages})"
        return f"{TARGET if rank in self.target_ranks else DRAFTER} rank {rank}"
