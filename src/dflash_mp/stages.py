"""Pipeline-staged targets: which decoder layers each of a replica's `target.stages` ranks runs.

A target too large for one GPU runs as a replica of `stages` consecutive ranks. Stage s runs layers
[first, end) of the truncated target (layers 0..max(layer_ids)) and streams the residual stream plus
the layers captured so far to stage s + 1 over the transport; the last stage sends the drafter its
batch exactly as a one-stage target does. Layers are split by forward cost (`flops.layer_forward_flops`),
not by count: a hybrid's linear-attention layers and a MoE's routed layers cost what they cost.

Everything here is pure: every rank derives the same plan from the config alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from .flops import causal_pairs_packed, layer_forward_flops


def layer_costs(config: dict, num_layers: int, seq_len: int, doc_len: int = 1024) -> list[float]:
    """Forward FLOPs of layers 0..num_layers-1 over one packed row of `doc_len`-token documents."""
    doc_len = max(1, min(doc_len, seq_len))
    docs = [doc_len] * (seq_len // doc_len) + ([seq_len % doc_len] if seq_len % doc_len else [])
    pairs = causal_pairs_packed(docs)
    return [layer_forward_flops(config, i, seq_len, pairs) for i in range(num_layers)]


def balanced_split(costs: list[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous [first, end) ranges, one per stage, each non-empty, minimising the largest stage
    cost (ties: the earliest stages take more, the last stage, which also sends to drafters, less)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: the smallest possible largest cost of layers 0..j-1 in s stages; cut[s][j] its last cut.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], prefix[j] - prefix[i])
                if v < best[s][j] * (1 - 1e-12) or (v <= best[s][j] * (1 + 1e-12) and i > cut[s][j]):
                    best[s][j], cut[s][j] = min(v, best[s][j]), i
    bounds, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    return bounds[::-1]


@dataclass(frozen=True)
class StagePlan:
    """The layer ranges of a replica's stages and what crosses each boundary."""

    bounds: tuple[tuple[int, int], ...]  # [first, end) per stage, over the truncated target's layers
    costs: tuple[float, ...]  # forward FLOPs per stage and packed row
    layer_ids: tuple[int, ...]  # captured layers, sorted
    hidden_size: int

    @property
    def stages(self) -> int:
        return len(self.bounds)

    def captured(self, stage: int) -> list[int]:
        """The captured layers stage `stage` runs."""
        first, end = self.bounds[stage]
        return [i for i in self.layer_ids if first <= i < end]

    def captured_before(self, stage: int) -> int:
        """How many captured layers the stages before `stage` ran (columns its input carries)."""
        return sum(len(self.captured(s)) for s in range(stage))

    def boundary_width(self, stage: int) -> int:
        """Columns of the message from stage `stage` to stage `stage + 1`: the residual stream, then
        the layers captured so far, each `hidden_size` wide."""
        return self.hidden_size * (1 + self.captured_before(stage + 1))

    def balance(self) -> float:
        """Mean stage cost over the largest: the fraction of a replica's GPU time the split can use."""
        return sum(self.costs) / len(self.costs) / max(self.costs)

    def describe(self) -> str:
        total = sum(self.costs)
        parts = [f"stage {s}: layers {a}-{b - 1} ({c / total:.0%} of the FLOPs, captures {self.captured(s)})"
                 for s, ((a, b), c) in enumerate(zip(self.bounds, self.costs))]
        return "; ".join(parts) + f"; balance {self.balance():.2f}"


def plan_stages(config: dict, layer_ids: list[int], stages: int, seq_len: int, doc_len: int = 1024) -> StagePlan:
    """Split the target's layers 0..max(layer_ids) into `stages` stages balanced by forward cost.
    Raises a ValueError naming the fix when there are fewer layers than stages."""
    num_layers = max(layer_ids) + 1
    if stages < 1:
        raise ValueError(f"target.stages={stages}: use 1 (the whole target on one rank) or more.")
    if stages > num_layers:
        raise ValueError(f"target.stages={stages}, but the target runs only {num_layers} layers (up to its last "
                         f"captured layer {max(layer_ids)}): use target.stages of at most {num_layers}.")
    costs = layer_costs(config, num_layers, seq_len, doc_len)
    bounds = balanced_split(costs, stages)
    stage_costs = tuple(sum(costs[a:b]) for a, b in bounds)
    return StagePlan(tuple(bounds), stage_costs, tuple(sorted(layer_ids)), config["hidden_size"])
