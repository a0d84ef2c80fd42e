"""Staged targets (target.stages): the cost-balanced split, and a target split into stages captures
exactly what the whole target captures, each stage holding only its own layers."""

import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_mp.archs import TINY_ARCHS, hf_config
from dflash_mp.batch import PackedBatch
from dflash_mp.builtin import build_demo_tokenizer, resolve_target_path
from dflash_mp.flops import layer_forward_flops
from dflash_mp.stages import balanced_split, layer_costs, plan_stages
from dflash_mp.target import TargetWorker, linear_attn, load_target_config
from dflash_mp.target.weights import stage_memory_error, stage_weight_bytes

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------ the split
def brute_force(costs, stages):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(edges[:-1], edges[1:]))
        best = worst if best is None else min(best, worst)
    return best


def test_balanced_split_minimises_the_largest_stage():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        costs = [rng.choice([1.0, 1.0, 3.0, 0.5]) * rng.uniform(0.8, 1.2) for _ in range(n)]
        for stages in range(1, n + 1):
            bounds = balanced_split(costs, stages)
            assert len(bounds) == stages and bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
            worst = max(sum(costs[a:b]) for a, b in bounds)
            assert worst == pytest.approx(brute_force(costs, stages))


def test_uniform_layers_split_evenly_and_the_plan_says_what_crosses_each_boundary():
    # Qwen3-8B shapes, layers 0..33 (last captured layer 33): 34 equal layers.
    cfg = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=12288, num_hidden_layers=36)
    plan = plan_stages(cfg, [1, 9, 17, 25, 33], 2, 3072)
    assert plan.bounds == ((0, 17), (17, 34))
    assert plan.balance() == pytest.approx(1.0)
    assert plan.captured(0) == [1, 9] and plan.captured(1) == [17, 25, 33]
    assert plan.boundary_width(0) == 4096 * 3  # residual + layers 1 and 9
    assert "stage 1: layers 17-33" in plan.describe()


def test_costs_follow_the_layer_type_not_the_count():
    hybrid = {**TINY_ARCHS["tiny-qwen3.5"], "vocab_size": 256, "num_hidden_layers": 8,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]}
    costs = layer_costs(hybrid, 8, 2048)
    assert costs[3] > costs[0] and costs[3] == costs[7] and costs[0] == costs[1]  # full attention pays T^2
    moe = {**TINY_ARCHS["tiny-qwen3-moe"], "vocab_size": 256, "num_experts": 4, "mlp_only_layers": [0]}
    dense0, routed1 = layer_forward_flops(moe, 0, 512, 0.0), layer_forward_flops(moe, 1, 512, 0.0)
    assert dense0 != routed1  # the dense MLP of an mlp_only layer against 2 of 4 routed experts
    # A cheap stretch of layers gets more layers: 6 linear layers then 2 expensive full ones.
    skewed = {**hybrid, "layer_types": ["linear_attention"] * 6 + ["full_attention"] * 2}
    plan = plan_stages(skewed, [7], 2, 4096)
    first, second = plan.bounds
    assert first[1] - first[0] > second[1] - second[0]


def test_impossible_stage_counts_name_the_fix():
    cfg = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=6)
    with pytest.raises(ValueError, match=r"target.stages=5, but the target runs only 4 layers .* at most 4"):
        plan_stages(cfg, [1, 3], 5, 256)
    with pytest.raises(ValueError, match="target.stages=0"):
        plan_stages(cfg, [1, 3], 0, 256)


# ------------------------------------------------------------------------ staged capture == whole
def packed_row(seed: int = 1, vocab: int = 200) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    lens = [70, 9, 33]  # the first longer than a 64-token Gated DeltaNet chunk
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)] + [torch.full((16,), -1)])
    pos = torch.cat([torch.arange(n) for n in lens] + [torch.zeros(16, dtype=torch.long)])
    ids = torch.randint(0, vocab, (docs.shape[0],), generator=g)
    return PackedBatch(ids, pos, docs, (docs >= 0).long(), len(lens), sum(lens))


def moe_checkpoint(tmp_path) -> str:
    """A tiny Qwen3-MoE saved as a real checkpoint: per-expert tensors on disk, fused in the model."""
    cfg = hf_config(TINY_ARCHS["tiny-qwen3-moe"], vocab_size=256)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
    out = str(tmp_path / "moe")
    model.save_pretrained(out)
    build_demo_tokenizer(["hello world"] * 8, vocab_size=200).save_pretrained(out)
    return out


TARGETS = {
    "checkpoint": lambda tmp: resolve_target_path("builtin:tiny-qwen3", str(tmp / "cache")),
    "random": lambda tmp: resolve_target_path("builtin:random-tiny-qwen3", str(tmp / "cache")),
    "hybrid-random": lambda tmp: resolve_target_path("builtin:random-tiny-qwen3.5", str(tmp / "cache")),
    "moe-checkpoint": moe_checkpoint,
}


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_stages_capture_exactly_what_one_stage_captures(tmp_path, kind):
    path = TARGETS[kind](tmp_path)
    cfg = load_target_config(path)
    n = cfg["num_hidden_layers"]
    layer_ids = [1, n // 2, n - 1]  # the last layer too: the last stage applies the final norm to it
    pb = packed_row()
    whole = TargetWorker.load(path, layer_ids, CPU, torch.float32)
    want = whole.forward(pb).hidden
    full_params = {k: v for k, v in whole.model.named_parameters()}
    assert stage_weight_bytes(path, 0, n, True, torch.float32) == sum(p.numel() * 4 for p in full_params.values())
    for stages in (2, 3):
        plan = plan_stages(cfg, layer_ids, stages, pb.seq_len)
        batch = pb
        for s, (first, end) in enumerate(plan.bounds):
            worker = TargetWorker.load(path, layer_ids, CPU, torch.float32, layers=(first, end))
            # Only this stage's layers exist, with the whole target's weights; the embedding on stage 0 only.
            own = dict(worker.model.named_parameters())
            layers = {int(k.split("layers.")[1].split(".")[0]) for k in own if "layers." in k}
            assert layers == set(range(first, end)), (s, layers)
            assert any("embed_tokens" in k for k in own) == (s == 0)
            for k, v in own.items():
                assert torch.equal(v, full_params[k]), k
            # What the start-up's memory check counts before loading is what the stage holds.
            held = sum(p.numel() * p.element_size() for p in worker.model.parameters())
            assert stage_weight_bytes(path, first, end, end == n, torch.float32) == held, (kind, s)
            batch = worker.forward(batch)
            if s < stages - 1:
                assert batch.hidden.shape == (pb.seq_len, plan.boundary_width(s))
        assert torch.equal(batch.hidden, want), (kind, stages)
        assert torch.equal(batch.input_ids, pb.input_ids) and torch.equal(batch.loss_mask, pb.loss_mask)


def test_a_later_stage_checks_its_own_layers_for_leaks(tmp_path, monkeypatch):
    """Stage 1 never sees token ids; its packing check feeds its layers a random residual stream and
    still catches a linear-attention layer that runs a packed row as one sequence. Each stage probes
    its own layers only."""
    path = resolve_target_path("builtin:random-tiny-qwen3.5", str(tmp_path / "cache"))
    diffs = TargetWorker.load(path, [0, 2, 3], CPU, torch.float32, layers=(2, 4)).check_packing()
    assert set(diffs) == {2, 3} and max(diffs.values()) < 1e-4
    first = TargetWorker.load(path, [0, 2, 3], CPU, torch.float32, layers=(0, 2)).check_packing()
    assert set(first) == {0, 1}
    monkeypatch.setattr(linear_attn.Spans, "of", classmethod(
        lambda cls, docs, device: cls(torch.tensor([0, docs.shape[0]]), device)))
    with pytest.raises(ValueError, match=r"Qwen3_5ForCausalLM: layer 2 \(linear_attention\) lets packed"):
        TargetWorker.load(path, [0, 2, 3], CPU, torch.float32, layers=(2, 4))
    with pytest.raises(ValueError, match=r"Qwen3_5ForCausalLM: layer 0 \(linear_attention\) lets packed"):
        TargetWorker.load(path, [0, 2, 3], CPU, torch.float32, layers=(0, 2))


def test_a_target_too_large_for_its_gpu_is_refused_before_any_weight_is_read(tmp_path):
    """The start-up's memory check (TargetWorker.load on CUDA asks it with the GPU's free memory): weights
    that fit pass; a stage that does not names the GPUs the target needs, or, where it would fit a GPU
    alone, the processes sharing it."""
    path = resolve_target_path("builtin:tiny-qwen3", str(tmp_path / "cache"))
    n = load_target_config(path)["num_hidden_layers"]
    whole = stage_weight_bytes(path, 0, n, True, torch.bfloat16)
    half = stage_weight_bytes(path, 0, n // 2, False, torch.bfloat16)
    assert half < whole == stage_weight_bytes(path, 0, n, True, torch.float32) // 2
    assert stage_memory_error(path, 0, n, n - 1, torch.bfloat16, whole, 10 * whole, "GPU 0") is None
    shared = stage_memory_error(path, 0, n, n - 1, torch.bfloat16, whole - 1, 10 * whole, "GPU 3")
    assert "GPU 3 has" in shared and "give the target a GPU of its own" in shared, shared
    # 2.8 GPUs' worth of weights: 4 GPUs (90% of each for weights), from stage 0's view as from the whole's.
    for end in (n, n // 2):
        why = stage_memory_error(path, 0, end, n - 1, torch.bfloat16, 0, int(whole / 2.8), "GPU 0")
        assert "split them over at least 4 GPUs with target.stages=4" in why, why
        assert f"the target's layers 0-{end - 1} hold" in why and "of bfloat16 weights" in why, why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_target_load_refuses_weights_that_do_not_fit_its_free_memory(tmp_path):
    """The 8B target's 15 GiB on a GPU with ~4 GiB left free: refused at once, naming the GPU."""
    path = resolve_target_path("builtin:random-qwen3-8b", str(tmp_path / "cache"))
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - 4 * 2 ** 30, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"hold 1\d\.\d GiB of bfloat16 weights and GPU 0 has [0-4]\.\d GiB free"):
        TargetWorker.load(path, [1, 9, 17, 25, 33], torch.device("cuda"), torch.bfloat16)
    del hog
