"""The split planner: pure layout arithmetic (`split`), checked by hand, `topology.num_target_ranks=auto`,
and the `dflash_mp.plan` report."""

import pytest

from dflash_mp import split
from dflash_mp.config import compose
from dflash_mp.flops import DrafterShape
from dflash_mp.plan import PlanConfig, format_report, memory_floor, planned_ids, target_config_for
from dflash_mp.split import (
    GIB,
    Layout,
    best_whole_split,
    fluid_bound,
    plan_layouts,
    shared_splits,
    whole_splits,
    workload,
)
from dflash_mp.target import TargetSpec


def resolve_num_target_ranks(job, world: int) -> int:
    """What main asks the planner, with the target resolved as a run resolves it (tests compose jobs
    of known hub ids: their config and tokenizer length come from the table)."""
    if job.topology.num_target_ranks != "auto":  # taken as set: the target is never read
        return split.resolve_num_target_ranks(job, world, {}, None, [], 0)
    tcfg = target_config_for(job)
    spec = TargetSpec.from_config(tcfg)
    return split.resolve_num_target_ranks(job, world, tcfg, spec, *planned_ids(job, tcfg, spec))


T, D = 10.4, 7.8  # samples/s per GPU: target, drafter


def by_split(layouts):
    return {(x.target_gpus, x.drafter_gpus, x.shared_gpus): x for x in layouts}


def test_whole_gpu_splits_cap_near_31():
    w = by_split(whole_splits(8, T, D))
    assert w[(3, 5, 0)].samples_per_s == pytest.approx(31.2)  # targets limit: 3 * 10.4
    assert w[(4, 4, 0)].samples_per_s == pytest.approx(31.2)  # drafters limit: 4 * 7.8
    assert w[(2, 6, 0)].samples_per_s == pytest.approx(20.8)
    assert len(w) == 7
    assert best_whole_split(8, T, D) == 3  # tie at 31.2: fewer target GPUs


def test_one_shared_gpu_paces_every_drafter_of_the_lock_step_group():
    # 3 target + 4 drafter GPUs + 1 shared: all 5 drafters step together, at the shared one's pace.
    # f balances 31.2 + 10.4 f = 5 * 7.8 (1 - f): f = 7.8 / 49.4, rate 31.2 + 10.4 * 7.8 / 49.4.
    s = by_split(shared_splits(8, T, D, efficiency=1.0))[(3, 4, 1)]
    assert s.target_share == pytest.approx(7.8 / 49.4)
    assert s.samples_per_s == pytest.approx(32.842, abs=1e-3)
    # Contention: the shared GPU delivers 90%: f = 3.9 / 44.46, rate 31.2 + 0.9 * 10.4 * f.
    s = by_split(shared_splits(8, T, D, efficiency=0.9))[(3, 4, 1)]
    assert s.samples_per_s == pytest.approx(32.021, abs=1e-3)
    # Every GPU shared by one target and one drafter reaches the fluid bound less contention.
    assert fluid_bound(8, T, D) == pytest.approx(35.657, abs=1e-3)
    best = plan_layouts(8, T, D, efficiency=0.9)[0]
    assert (best.target_gpus, best.drafter_gpus, best.shared_gpus) == (0, 0, 8)
    assert best.samples_per_s == pytest.approx(0.9 * 35.657, abs=1e-3)
    assert (best.num_processes, best.num_target_ranks) == (16, 8)


def test_two_gpu_ranking_matches_the_h200_measurement():
    # Per-GPU rates measured alone on an H200 at Qwen3-8B shapes (target forward 70.1 ms, drafter
    # step 125.2 ms); measured on 2 H200s (BENCHMARKS.md): 2+2 sharing both GPUs 9.24 samples/s,
    # 1+1 whole GPUs 8.01, 1 target + 2 drafters with one drafter on the target's GPU 6.83.
    t, d = 1000 / 70.1, 1000 / 125.2
    got = {(x.target_gpus, x.drafter_gpus, x.shared_gpus): x.samples_per_s for x in plan_layouts(2, t, d)}
    measured = {(0, 0, 2): 9.24, (1, 1, 0): 8.01, (0, 1, 1): 6.83}
    assert sorted(got, key=got.get, reverse=True) == sorted(measured, key=measured.get, reverse=True)
    for k, v in measured.items():
        assert got[k] == pytest.approx(v, rel=0.03), (k, got[k], v)


def test_shared_layouts_only_where_both_roles_get_time():
    for lay in shared_splits(8, T, D):
        assert 0 < lay.target_share < 1 and lay.target_gpus + lay.drafter_gpus == 7
    # Rates that divide evenly: 2 targets feed 6 drafters exactly; sharing cannot beat it.
    best = plan_layouts(8, 9.0, 3.0, efficiency=1.0)[0]
    assert (best.target_gpus, best.drafter_gpus, best.shared_gpus) == (2, 6, 0)
    assert best.samples_per_s == pytest.approx(18.0)


def test_report_lists_every_layout():
    layouts = plan_layouts(8, T, D)
    text = format_report(8, T, D, layouts, 3072)
    assert text.count("samples/s") >= 3 and "<- best" in text
    assert len([ln for ln in text.splitlines() if "GPUs" in ln and ln.startswith("  ")]) == len(layouts)
    assert "topology.num_target_ranks=3" in text and "shares every GPU: torchrun --nproc-per-node 16" in text


def test_one_gpu_has_one_layout_a_target_and_a_drafter_taking_turns():
    """Per-part times of the 8B job measured on one H200 (call W, BENCHMARKS.md: target forward 66.99 ms,
    drafter step 120.75 ms); the job itself, 1 + 1 on that GPU taking turns, ran 5.335 samples/s."""
    t, d = 1000 / 66.99, 1000 / 120.75
    (only,) = plan_layouts(1, t, d, efficiency=0.5, turns_efficiency=PlanConfig.turns_efficiency)
    assert (only.target_gpus, only.drafter_gpus, only.shared_gpus, only.num_processes) == (0, 0, 1, 2)
    assert only.samples_per_s == pytest.approx(5.335, rel=0.01)
    assert only.target_share == pytest.approx(66.99 / (66.99 + 120.75))
    # One GPU's rate follows the turns' efficiency; the shared-GPU efficiency of larger worlds does not apply.
    assert plan_layouts(1, t, d, turns_efficiency=0.5)[0].samples_per_s == pytest.approx(only.samples_per_s / 2)
    text = format_report(1, t, d, [only], 3072)
    assert "one GPU: 5.3" in text and "1 GPU shared by a target and a drafter (36% target)" in text
    assert "torchrun --nproc-per-node 2" in text and "whole-GPU" not in text
    assert text.splitlines()[-1].startswith("memory is not checked")  # no GPU's memory: a 1 + 1 may not fit
    # With the job's memory floor and a GPU: a 1 + 1 over the GPU is no layout, and the fix is more GPUs.
    floor = split.MemoryFloor(target=13 * GIB, drafter=16 * GIB, drafter_dp=20 * GIB)
    text = format_report(1, t, d, [only], 3072, floor=floor, gpu=24 * GIB, gpu_from="plan.gpu_memory_gib=24")
    assert ("(does not fit: a GPU holding a target and a drafter holds >= 29.0 GiB, the GPU 24.0)" in text
            and "torchrun" not in text and "no layout fits on 1 GPU" in text and "use 2 or more GPUs" in text)
    assert "<- the only layout" in format_report(1, t, d, [only], 3072, floor=floor, gpu=29 * GIB)
    with pytest.raises(ValueError, match="world_size=1 has no room for one target replica of target.stages=2"):
        plan_layouts(1, t, d, stages=2)


def test_memory_floor_of_a_layout_by_hand():
    """The most any GPU of a layout holds: a target rank, a drafter rank (one of several: the data-parallel
    sum's buffer besides), or both on a shared GPU."""
    f = split.MemoryFloor(target=40 * GIB, drafter=20 * GIB, drafter_dp=25 * GIB)
    assert f.per_gpu(Layout(7, 1, 0, 0.0, 1.0)) == 40 * GIB  # the only drafter rank holds 20
    assert f.per_gpu(Layout(4, 3, 1, 0.1, 1.0)) == 65 * GIB  # the shared GPU's drafter is one of 4
    assert f.per_gpu(Layout(0, 0, 1, 0.5, 1.0)) == 60 * GIB  # one GPU: the only drafter
    assert f.per_gpu(Layout(0, 0, 8, 0.5, 1.0)) == 65 * GIB
    assert f.misfit(Layout(4, 3, 1, 0.1, 1.0), 65 * GIB) is None
    assert f.misfit(Layout(4, 3, 1, 0.1, 1.0), 64 * GIB) == ("a GPU holding a target and a drafter holds >= "
                                                             "65.0 GiB, the GPU 64.0")
    assert f.misfit(Layout(4, 4, 0, 0.0, 1.0), 39 * GIB) == "a target rank holds >= 40.0 GiB, the GPU 39.0"
    big = split.MemoryFloor(target=10 * GIB, drafter=50 * GIB, drafter_dp=60 * GIB)
    assert big.misfit(Layout(4, 4, 0, 0.0, 1.0), 55 * GIB) == "a drafter rank holds >= 60.0 GiB, the GPU 55.0"
    assert big.misfit(Layout(7, 1, 0, 0.0, 1.0), 55 * GIB) is None


def test_memory_floor_of_the_8b_job_counted_by_hand():
    """plan.memory_floor builds the target and drafter on the meta device; Qwen3-8B's weights by hand:
    the target truncated after layer 33 (34 layers, the embedding, the final norm, no LM head), the
    drafter's 5 layers, its fc over the 5 captured layers and 2 norms at 14 bytes a parameter (bf16
    working weights with the split master, their gradients, two fp32 moments; 18 with 2+ replicas),
    plus the target's embedding and LM head it reads."""
    job = compose(["experiment=qwen3_8b"])
    tcfg = target_config_for(job)
    spec = TargetSpec.from_config(tcfg)
    ids, mask = planned_ids(job, tcfg, spec)
    floor = memory_floor(job, tcfg, spec, ids, mask, [(0, max(ids) + 1)])
    H, I, V, q, kv = 4096, 12288, 151936, 32 * 128, 8 * 128
    layer = 2 * H * q + 2 * H * kv + 3 * H * I + 2 * H + 2 * 128  # q, o; k, v; the MLP; 2 norms; q/k norms
    assert max(ids) == 33 and len(ids) == 5
    assert floor.target == 2 * (34 * layer + V * H + H)
    n = 5 * layer + 5 * H * H + 2 * H
    assert floor.drafter == 14 * n + 2 * 2 * V * H
    assert floor.drafter_dp == 18 * n + 2 * 2 * V * H
    staged = memory_floor(job, tcfg, spec, ids, mask, [(0, 17), (17, 34)])
    assert staged.target == 2 * (17 * layer + V * H)  # the first stage: the embedding, no final norm


def test_one_step_s_memory_estimated_by_hand():
    """What a step adds on top of the floor, from the shapes: the drafter's per-layer activations of its
    A*B block rows (input and attention sum, each normalised too; q before and after RoPE, the attention's
    output; gate, up, their product) and k (before and after RoPE) and v of context and block rows, the
    received states and fused context (before and after its norm), the CE's logits chunk and the rows'
    gradient; the target's residual and a layer's transients, and the captured states in flight."""
    shape = DrafterShape(hidden=8, intermediate=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                         vocab=32, num_target_layers=3)
    # 12 block rows, q = 8, kv = 4: a layer 12 * (32 + 24 + 48) + (12 + 10) * 12; context 10 * 5 * 8; CE: 5
    # of the 9 predicted rows' logits, the 9 rows' gradient.
    layer = 12 * (32 + 24 + 48) + 22 * 12
    assert split.drafter_step_bytes(shape, 10, 3, 4, chunk_rows=5) == 2 * (2 * layer + 400 + 5 * 32 + 9 * 8)
    wide = split.drafter_step_bytes(shape, 10, 3, 4, chunk_rows=64, itemsize=4)  # all 9 rows' logits
    assert wide == 4 * (2 * layer + 400 + 9 * 32 + 9 * 8)
    tc = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16,
              num_hidden_layers=2, vocab_size=32)
    # 10 tokens x (2 x 8 + 8 + 2 x 4 + 3 x 16); 3 captured layers x 10 x 8, filling and 2 in flight.
    assert split.target_step_bytes(TargetSpec.from_config(tc), 10, 3, depth=2) == 2 * (10 * 80 + 3 * 240)
    moe = dict(tc, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6)  # 2 experts of 6 a token
    moe_spec = TargetSpec.from_config(moe)
    assert split.target_step_bytes(moe_spec, 10, 3, depth=1) == 2 * (10 * (32 + 36) + 2 * 240)
    # kv heads and head_dim left out of a config are read as TargetSpec reads them (heads, hidden / heads):
    # 10 tokens x (2 x 8 + 8 + 2 x 8 + 3 x 16).
    bare = dict(tc, num_key_value_heads=None, head_dim=None)
    assert split.target_step_bytes(TargetSpec.from_config(bare), 10, 3, depth=2) == 2 * (10 * 88 + 720)
    # The 8B job's figures through plan.memory_floor (drafter.loss_chunk_size=4096, transport.depth=2).
    job = compose(["experiment=qwen3_8b"])
    tcfg = target_config_for(job)
    spec = TargetSpec.from_config(tcfg)
    ids, mask = planned_ids(job, tcfg, spec)
    floor = memory_floor(job, tcfg, spec, ids, mask, [(0, max(ids) + 1)])
    H, I, V, q, kv, T, rows = 4096, 12288, 151936, 4096, 1024, 3072, 512 * 16
    layer = rows * (4 * H + 3 * q + 3 * I) + (rows + T) * 3 * kv
    assert floor.drafter_step == 2 * (5 * layer + T * 7 * H + 4096 * V + 512 * 15 * H)
    assert floor.target_step == 2 * (T * (2 * H + q + 2 * kv + 3 * I) + 3 * T * 5 * H)
    assert 6.5 * GIB < floor.drafter_step < 7 * GIB and 0.5 * GIB < floor.target_step < 0.7 * GIB
    # A target that ties its embedding and LM head leaves drafter ranks one V x H tensor fewer (bf16).
    tied = dict(tcfg, tie_word_embeddings=True)
    tied_floor = memory_floor(job, tied, TargetSpec.from_config(tied), ids, mask, [(0, max(ids) + 1)])
    assert floor.drafter - tied_floor.drafter == floor.drafter_dp - tied_floor.drafter_dp == 2 * V * H


def test_the_estimate_counts_what_the_compiled_layers_save_for_the_backward(monkeypatch):
    """The drafter's step compiled as a run compiles it (each layer, default mode), its saved tensors
    summed by storage: within a few percent of `drafter_step_bytes` without the CE's logits chunk (a
    transient). Left out: the weights, the target's embedding and head, and the CPU's dense attention
    mask (one per layer: CUDA runs the block kernels, which take spans)."""
    from pathlib import Path

    import torch

    from dflash_mp.model import DFlashDrafter, DrafterArgs
    from dflash_mp.trainer import DFlashObjective, DrafterConfig, DrafterTrainer, TrainConfig

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from common import synthetic_batch

    H, V, T, A, B, chunk = 96, 256, 256, 16, 8, 64
    args = DrafterArgs(hidden_size=H, intermediate_size=160, num_layers=3, num_heads=4, num_kv_heads=2,
                       head_dim=16, vocab_size=V, target_layer_ids=[1, 2, 3], block_size=B,
                       mask_token_id=V - 1)
    torch.manual_seed(0)
    drafter = DFlashDrafter(args).to(torch.bfloat16)
    embed, head = (torch.randn(V, H) * 0.02).bfloat16(), (torch.randn(V, H) * 0.02).bfloat16()
    objective = DFlashObjective(drafter, args, embed, head, DrafterConfig(
        block_size=B, num_anchors=A, max_anchors_per_doc=16, loss_chunk_size=chunk, attention="dense"))
    cfg = TrainConfig(compile="default", compile_scope="layers", warmup_ratio=0.0, precision="bf16")
    trainer = DrafterTrainer(objective, cfg, 10, None, torch.device("cpu"))
    batch = synthetic_batch(T, 3 * H, V, "cpu", torch.bfloat16, seed=0, lo=64, hi=200)
    trainer.forward_backward(batch)  # compiles
    held = {t.untyped_storage().data_ptr() for t in (*drafter.parameters(), embed, head)}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in held and tuple(t.shape) != (1, 1, A * B, T + A * B):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.forward_backward(batch)
    estimate = split.drafter_step_bytes(DrafterShape.from_args(args), T, A, B, chunk) - 2 * chunk * V
    assert 0.95 < sum(saved.values()) / estimate < 1.05, (sum(saved.values()), estimate)


def test_a_layout_over_the_estimate_is_marked_and_never_recommended():
    """Floors that fit, estimates that do not: the layout is marked as likely out of memory, the best and
    the recommendation skip it; the estimate's arithmetic per layout by hand."""
    f = split.MemoryFloor(target=40 * GIB, drafter=20 * GIB, drafter_dp=25 * GIB, target_step=2 * GIB,
                          drafter_step=10 * GIB)
    assert f.per_gpu(Layout(4, 4, 0, 0.0, 1.0), step=True) == 42 * GIB  # drafter ranks hold 35
    assert f.per_gpu(Layout(7, 1, 0, 0.0, 1.0), step=True) == 42 * GIB  # the only drafter rank holds 30
    assert f.per_gpu(Layout(4, 3, 1, 0.1, 1.0), step=True) == 77 * GIB
    assert f.per_gpu(Layout(1, 7, 0, 0.0, 1.0), step=True) == 42 * GIB
    assert f.misfit(Layout(4, 4, 0, 0.0, 1.0), 41 * GIB) is None
    assert f.misfit(Layout(4, 4, 0, 0.0, 1.0), 41 * GIB, step=True) == (
        "a target rank needs ~42.0 GiB with one step's activations (estimated), the GPU 41.0")
    big = split.MemoryFloor(target=10 * GIB, drafter=20 * GIB, drafter_dp=25 * GIB, drafter_step=20 * GIB)
    assert big.misfit(Layout(4, 4, 0, 0.0, 1.0), 44 * GIB, step=True) == (
        "a drafter rank needs ~45.0 GiB with one step's activations (estimated), the GPU 44.0")
    assert big.misfit(Layout(7, 1, 0, 0.0, 1.0), 44 * GIB, step=True) is None  # one drafter: 40
    layouts = plan_layouts(8, T, D)
    text = format_report(8, T, D, layouts, 3072, floor=big, gpu=44 * GIB, gpu_from="plan.gpu_memory_gib=44")
    lines = text.splitlines()
    marked = [ln for ln in lines if "(likely out of memory: " in ln]
    assert all("<- best" not in ln for ln in marked)
    assert len(marked) + 1 == sum(ln.startswith("  ") for ln in lines)  # all but the one with 1 drafter GPU
    assert sum("a drafter rank needs ~45.0 GiB" in ln for ln in marked) == 6  # whole splits, 2+ drafters
    assert sum("a target and a drafter needs ~55.0 GiB" in ln for ln in marked) == 5  # shared: 10 + 25 + 20
    assert "7 target + 1 drafter GPUs  <- best" in text and "topology.num_target_ranks=7" in text
    assert f"of {len(layouts)} layouts, 0 over the floor and {len(layouts) - 1} over the estimate" in text


def test_cli_checks_the_layouts_against_a_gpu_s_memory(capsys):
    """Qwen3.5-27B on 8 GPUs: 80 GB cards hold no target and drafter together, so the best layout that
    fits is a whole-GPU split and no shared launch is offered; 141 GB cards hold both."""
    from dflash_mp.plan import main

    main(["experiment=qwen3_5_27b", "plan.world_size=8", "plan.gpu_memory_gib=79.2"])
    out = capsys.readouterr().out
    layouts = [ln.strip() for ln in out.splitlines() if ln.startswith("  ") and "GPU" in ln]
    shared = [ln for ln in layouts if "shared" in ln]
    assert len(layouts) == 13 and len(shared) == 6
    assert all("(does not fit: a GPU holding a target and a drafter holds >= " in ln for ln in shared)
    assert "4 target + 4 drafter GPUs  <- best" in out and "best overall shares" not in out
    assert "recommended whole-GPU split: topology.num_target_ranks=4 (torchrun --nproc-per-node 8)" in out
    assert ("checked against 79.2 GiB a GPU (plan.gpu_memory_gib=79.2): of 13 layouts, 6 over the floor and "
            "0 over the estimate") in out
    main(["experiment=qwen3_5_27b", "plan.world_size=8", "plan.gpu_memory_gib=139.8"])
    out = capsys.readouterr().out
    assert "does not fit" not in out and "best overall shares one GPU: torchrun --nproc-per-node 9" in out
    # One 80 GB card: the 27B 1 + 1 clears the floor (73.6 GiB) but not the estimate with a step's
    # activations; on that card it ran out of memory (BENCHMARKS.md, calls B2 and C1). On 141 GB it runs.
    main(["experiment=qwen3_5_27b", "plan.world_size=1", "plan.gpu_memory_gib=79.2"])
    out = capsys.readouterr().out
    assert "(likely out of memory: a GPU holding a target and a drafter needs ~82.5 GiB" in out
    assert "no layout fits on 1 GPU: a target and a drafter rank need a GPU each (together ~82.5 GiB)" in out
    assert "torchrun" not in out
    main(["experiment=qwen3_5_27b", "plan.world_size=1", "plan.gpu_memory_gib=139.8"])
    out = capsys.readouterr().out
    assert "<- the only layout" in out and "out of memory:" not in out
    # Qwen3-235B-A22B's 4 stages hold more than an 80 GB card each: no layout, and the fix.
    main(["experiment=qwen3_235b_a22b", "plan.world_size=8", "plan.gpu_memory_gib=79.2"])
    out = capsys.readouterr().out
    assert "no layout fits: a target rank's weights alone hold" in out and "target.stages (now 4;" in out
    assert "recommended" not in out and "<- best" not in out
    with pytest.raises(ValueError, match=r"plan.gpu_memory_gib=0: give a GPU's memory in GiB"):
        main(["experiment=qwen3_8b", "plan.gpu_memory_gib=0"])


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"world_size=0: plan for 1 GPU or more"):
        plan_layouts(0, T, D)
    with pytest.raises(ValueError, match="positive"):
        plan_layouts(8, 0.0, D)


def test_flop_workload_by_hand():
    # One drafter layer of width 8, two captured target layers, no attention cost to speak of.
    shape = DrafterShape(hidden=8, intermediate=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                         vocab=32, num_target_layers=2)
    tc = dict(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
              num_hidden_layers=2, vocab_size=32)  # a whole config: read through TargetSpec
    w = workload(tc, [0, 1], shape, seq_len=4, num_anchors=1, block_size=2, doc_len=4)
    # Target: 2 layers x (4 tokens x (2*8*(8+8) + 2*8*8 + 2*3*8*16) + 4*2*4 * 10 causal pairs)
    assert w.target_flops == 2 * (4 * (256 + 128 + 768) + 32 * 10)
    t, d = w.rates(1.0, 0.5, 0.5)
    assert t == pytest.approx(0.5e12 / w.target_flops) and d == pytest.approx(0.5e12 / w.drafter_flops)


def test_num_target_ranks_auto_resolves_from_flops():
    job = compose(["experiment=qwen3_8b", "topology.num_target_ranks=auto"])
    assert job.topology.num_target_ranks == "auto"
    n = resolve_num_target_ranks(job, 8)
    assert 1 <= n <= 7
    layouts = plan_layouts(8, *_rates(job))
    assert n == max((x for x in layouts if not x.shared_gpus), key=lambda x: x.samples_per_s).target_gpus
    assert resolve_num_target_ranks(compose(["topology.num_target_ranks=2"]), 8) == 2
    with pytest.raises(ValueError, match="'auto'"):
        resolve_num_target_ranks(compose(["topology.num_target_ranks=half"]), 8)


def _rates(job):
    tcfg = target_config_for(job)
    spec = TargetSpec.from_config(tcfg)
    return split.job_workload(job, tcfg, spec, *planned_ids(job, tcfg)).rates(790.0, split.TARGET_MFU,
                                                                              split.DRAFTER_MFU)


def test_cli_prints_layouts(capsys):
    from dflash_mp.plan import main

    main(["target=qwen3_8b", "drafter=qwen3_8b", "world_size=8", "data.seq_len=3072", "peak_tflops=790",
          "target_mfu=0.6", "drafter_mfu=0.5"])
    out = capsys.readouterr().out
    assert "recommended whole-GPU split: topology.num_target_ranks=" in out
    assert out.count("target +") >= 7


def test_cli_plans_one_gpu_at_the_turns_efficiency(capsys):
    """`plan.world_size=1`: the one layout at the fluid bound (plan.turns_efficiency, 1.0), not at the
    0.9 of GPUs shared without turns, and the launch that runs it."""
    import re

    from dflash_mp.plan import main

    main(["experiment=qwen3_8b", "plan.world_size=1", "plan.peak_tflops=790"])
    out = capsys.readouterr().out
    t, d = _rates(compose(["experiment=qwen3_8b"]))
    got = float(re.search(r"one GPU: ([0-9.]+) samples/s", out).group(1))
    assert got == pytest.approx(fluid_bound(1, t, d), rel=1e-3)
    assert "torchrun --nproc-per-node 2 -m dflash_mp.main" in out


def test_measure_runs_on_this_device():
    from dflash_mp.plan import measure_rates
    from dflash_mp.runtime import resolve

    job = resolve(compose(["data.seq_len=64", "drafter.num_anchors=8", "drafter.loss_chunk_size=32",
                           "train.compile=eager"]))  # the planner reads real paths
    t, d = measure_rates(job, target_config_for(job), iters=1)
    assert t > 0 and d > 0


def test_layout_properties():
    lay = Layout(3, 4, 1, 0.4, 35.0)
    assert lay.num_processes == 9 and lay.num_target_ranks == 4 and "1 shared (40% target)" in lay.describe()


# ------------------------------------------------------------------------- staged targets (target.stages)
def test_staged_splits_count_whole_replicas_at_the_stage_balance():
    # Replicas of 2 GPUs, each 2 * 10.4 * 0.9 samples/s: only even target counts exist.
    w = by_split(whole_splits(8, T, D, stages=2, balance=0.9))
    assert sorted(w) == [(2, 6, 0), (4, 4, 0), (6, 2, 0)]
    assert w[(2, 6, 0)].samples_per_s == pytest.approx(2 * 10.4 * 0.9)  # one replica limits
    assert w[(4, 4, 0)].samples_per_s == pytest.approx(31.2)  # drafters limit: 4 * 7.8
    assert w[(6, 2, 0)].samples_per_s == pytest.approx(15.6)
    assert [lay.num_replicas for lay in whole_splits(8, T, D, stages=2)] == [1, 2, 3]
    assert best_whole_split(8, T, D, stages=2, balance=0.9) == 4


def test_stage_balance_moves_the_best_split():
    # t = 4, d = 6: balanced replicas (8 samples/s each) need 2 of them for 4 drafters (16 vs 24);
    # at balance 0.5 a replica gives 4 samples/s and three of them (12) match 2 drafters (12).
    assert best_whole_split(8, 4.0, 6.0, stages=2, balance=1.0) == 4
    assert best_whole_split(8, 4.0, 6.0, stages=2, balance=0.5) == 6
    best = plan_layouts(8, 4.0, 6.0, stages=2, balance=0.5)[0]
    assert (best.target_gpus, best.num_replicas, best.samples_per_s) == (6, 3, pytest.approx(12.0))


def test_staged_plans_consider_only_whole_splits_of_whole_replicas():
    layouts = plan_layouts(8, T, D, stages=4, balance=0.95)
    assert [(x.target_gpus, x.drafter_gpus, x.shared_gpus, x.stages) for x in layouts] == [(4, 4, 4 - 4, 4)]
    layouts = plan_layouts(12, T, D, stages=3)
    assert {x.target_gpus for x in layouts} == {3, 6, 9} and not any(x.shared_gpus for x in layouts)
    assert Layout(4, 4, 0, 0.0, 31.2, 2).describe() == "2 target replicas x 2 stages (4 GPUs) + 4 drafter GPUs"
    assert Layout(4, 4, 0, 0.0, 31.2, 4).describe() == "1 target replica x 4 stages (4 GPUs) + 4 drafter GPUs"


@pytest.mark.parametrize("world,stages", [(4, 4), (2, 2), (3, 3), (5, 8)])
def test_staged_plan_without_room_for_a_replica_and_a_drafter_names_the_fix(world, stages):
    fix = rf"world_size={world}.*target.stages={stages}.*at least {stages + 1} GPUs, or fewer target.stages"
    with pytest.raises(ValueError, match=fix):
        plan_layouts(world, T, D, stages=stages)
    with pytest.raises(ValueError, match=fix):
        best_whole_split(world, T, D, stages=stages)


def test_staged_report_names_replicas_and_a_multiple_of_the_stages():
    layouts = plan_layouts(8, T, D, stages=2, balance=0.9)
    text = format_report(8, T, D, layouts, 3072, stages=2, balance=0.9)
    assert "per target replica of 2 stages: 18.72 samples/s (stage balance 0.90)" in text
    assert "2 target replicas x 2 stages (4 GPUs) + 4 drafter GPUs  <- best" in text
    assert "1 target replica x 2 stages (2 GPUs) + 6 drafter GPUs" in text
    assert "recommended whole-GPU split: topology.num_target_ranks=4 target.stages=2 (2 replica(s);" in text
    assert "shares" not in text


def test_num_target_ranks_auto_counts_replicas_of_the_staged_target():
    job = compose(["experiment=qwen3_8b", "topology.num_target_ranks=auto", "target.stages=2"])
    tcfg = target_config_for(job)
    layer_ids, _ = planned_ids(job, tcfg)
    balance = split.stage_balance(job, tcfg, layer_ids)
    assert 0.9 < balance <= 1.0
    t, d = _rates(job)
    n = resolve_num_target_ranks(job, 8)
    assert n % 2 == 0 and n == best_whole_split(8, t, d, 2, balance)
    # Unstaged, the same rates pick an odd count: the staged answer is not the one-GPU answer rounded.
    assert best_whole_split(8, t, d) % 2 == 1
    # The planner counts a replica at its stage balance: 34 layers in 3 stages of 12, 11, 11.
    job3 = compose(["experiment=qwen3_8b", "target.stages=3"])
    assert split.stage_balance(job3, tcfg, layer_ids) == pytest.approx(34 / 3 / 12)
    job4 = compose(["experiment=qwen3_8b", "topology.num_target_ranks=auto", "target.stages=4"])
    assert resolve_num_target_ranks(job4, 8) == 4
    with pytest.raises(ValueError, match="at least 5 GPUs, or fewer target.stages"):
        resolve_num_target_ranks(job4, 4)


def test_num_target_ranks_auto_weighs_replicas_by_their_stage_balance(monkeypatch):
    job = compose(["experiment=qwen3_8b", "topology.num_target_ranks=auto", "target.stages=2"])
    t, d = _rates(job)
    assert best_whole_split(8, t, d, 2, 1.0) != best_whole_split(8, t, d, 2, 0.1)
    monkeypatch.setattr(split, "stage_balance", lambda job, tcfg, layer_ids: 0.1)  # a badly balanced split
    assert resolve_num_target_ranks(job, 8) == best_whole_split(8, t, d, 2, 0.1)


def test_cli_prints_replicas_of_a_staged_target(capsys):
    from dflash_mp.plan import main

    # Llama-3.3-70B over 2 stages: 1.431 samples/s per GPU for the whole truncated target, 3.377 for
    # the drafter; a balanced replica of 2 GPUs gives 2.862: 3 replicas (8.59) are held to what 2
    # drafters take (6.75), still more than 2 replicas (5.72) feeding 4 drafters.
    main(["experiment=llama3_3_70b", "world_size=8", "peak_tflops=790", "target_mfu=0.75", "drafter_mfu=0.7"])
    out = capsys.readouterr().out
    assert "target.stages=2: stage 0: layers 0-38 (50% of the FLOPs, captures [1, 20])" in out
    assert "per target replica of 2 stages: 2.862 samples/s (stage balance 1.00)" in out
    layouts = [ln.strip() for ln in out.splitlines() if "drafter GPUs" in ln]
    assert layouts == ["6.753  3 target replicas x 2 stages (6 GPUs) + 2 drafter GPUs  <- best",
                       "5.724  2 target replicas x 2 stages (4 GPUs) + 4 drafter GPUs",
                       "2.862  1 target replica x 2 stages (2 GPUs) + 6 drafter GPUs"]
    assert "recommended whole-GPU split: topology.num_target_ranks=6 target.stages=2 (3 replica(s);" in out
    with pytest.raises(ValueError, match="world_size=4 .*target.stages=4.*at least 5 GPUs, or fewer target.stages"):
        main(["target=qwen3_8b", "drafter=qwen3_8b", "target.stages=4", "world_size=4"])
