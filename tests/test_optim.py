"""FlatAdamW: the trainer's weights, gradients and optimizer state in flat buffers it owns."""

import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks

from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.optim import FlatAdamW, adamw_update
from dflash_mp.trainer import DFlashObjective, DrafterConfig, DrafterTrainer, TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import synthetic_batch  # noqa: E402

ARGS = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
            vocab_size=128, target_layer_ids=[1, 2], block_size=8, mask_token_id=127)


def _trainer(grad_clip: float = 1.0, precision: str = "fp32", group=None) -> DrafterTrainer:
    args = DrafterArgs(**ARGS)
    torch.manual_seed(0)
    obj = DFlashObjective(DFlashDrafter(args), args, torch.randn(128, 32) * 0.02, torch.randn(128, 32) * 0.02,
                          DrafterConfig(block_size=8, num_anchors=8, max_anchors_per_doc=4, loss_chunk_size=16))
    cfg = TrainConfig(compile="eager", warmup_ratio=0.0, lr=1e-2, grad_clip=grad_clip, weight_decay=0.1,
                      precision=precision)
    return DrafterTrainer(obj, cfg, 10, group, torch.device("cpu"))


def _batch(seed: int = 0):
    return synthetic_batch(64, 2 * 32, 128, "cpu", torch.float32, seed=seed, lo=16, hi=40)


def _inside(t: torch.Tensor, flat: torch.Tensor) -> bool:
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    return lo <= t.data_ptr() < hi


@pytest.mark.parametrize("write_grads", [True, False])
def test_gradients_land_in_one_buffer_that_steps_reuse(write_grads):
    tr = _trainer()
    if not write_grads:
        tr = DrafterTrainer(tr.objective, tr.cfg, 10, None, torch.device("cpu"), write_grads=False)
    flat = tr.opt.grad
    assert all(_inside(p, tr.opt.master) for p in tr.params)  # fp32: the working weights are the master
    for step in range(2):
        tr.set_lr()
        tr.forward_backward(_batch(step))
        if write_grads:  # written into the buffer, the .grad tensors dropped
            assert all(p.grad is None for p in tr.params)
        else:  # backward added into views of the buffer
            assert all(_inside(p.grad, flat) for p in tr.params)
        assert flat.abs().sum() > 0
        before = tr.opt.master.clone()
        tr.optimizer_step()
        assert not torch.equal(before, tr.opt.master)
        assert flat.data_ptr() == tr.opt.grad.data_ptr()


def test_written_and_added_gradients_give_the_same_steps():
    runs = []
    for write in (True, False):
        tr = _trainer()
        tr = DrafterTrainer(tr.objective, tr.cfg, 10, None, torch.device("cpu"), write_grads=write)
        torch.manual_seed(3)
        for step in range(3):
            tr.set_lr()
            for micro in range(2):  # accumulation: the second backward adds to the first
                tr.forward_backward(_batch(2 * step + micro), grad_scale=0.5)
            runs.append(tr.opt.grad.clone())
            tr.optimizer_step()
        runs.append(tr.opt.master.clone())
    half = len(runs) // 2
    for a, b in zip(runs[:half], runs[half:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def _reference_step(tr: DrafterTrainer, clip: float):
    """torch's clip_grad_norm_ + AdamW on fp32 copies of the weights, with the trainer's gradients."""
    ref = [torch.nn.Parameter(w.detach().clone()) for w in tr.opt.named_master().values()]
    for r, g in zip(ref, tr.opt.grad_views):
        r.grad = g.float().clone()
    norm = torch.nn.utils.clip_grad_norm_(ref, clip) if clip > 0 else None
    torch.optim.AdamW(ref, lr=tr.opt.lr, betas=tr.cfg.betas, weight_decay=0.1, foreach=False).step()
    return ref, norm


@pytest.mark.parametrize("clip", [1e-3, 1e6, 0.0])  # clipping bites / never bites / disabled
def test_clip_and_update_equal_clip_grad_norm_then_torch_adamw(clip):
    tr = _trainer(clip)
    init = [p.detach().clone() for p in tr.params]
    tr.set_lr()
    tr.forward_backward(_batch())
    ref, norm = _reference_step(tr, clip)
    tr.optimizer_step()
    assert sum(float((p.detach() - i).abs().sum()) for p, i in zip(tr.params, init)) > 0
    for r, p in zip(ref, tr.params):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-7)
    stats = tr.stats.pop()
    if norm is not None:
        torch.testing.assert_close(stats["gnorm_sum"].float(), norm, rtol=1e-5, atol=0)
    assert stats["skipped"] == 0


def test_bf16_working_weights_follow_fp32_master_weights():
    """precision=bf16: the model computes with bf16 views, AdamW updates fp32 master weights."""
    tr = _trainer(1.0, "bf16")
    assert tr.opt.work.dtype == torch.bfloat16 and tr.opt.grad.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 and _inside(p, tr.opt.work) for p in tr.params)
    ref = [torch.nn.Parameter(w.detach().clone()) for w in tr.opt.named_master().values()]
    opt = torch.optim.AdamW(ref, lr=1.0, betas=tr.cfg.betas, weight_decay=0.1, foreach=False)
    for step in range(3):
        tr.set_lr()
        tr.forward_backward(_batch(step))
        for r, g in zip(ref, tr.opt.grad_views):
            r.grad = g.float().clone()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        opt.param_groups[0]["lr"] = tr.opt.lr
        opt.step()
        tr.optimizer_step()
        master = tr.opt.named_master()
        for r, name in zip(ref, tr.opt.names):
            # The same update to fp32 weights: updates far below bf16's resolution still land.
            torch.testing.assert_close(master[name], r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(tr.opt.work, tr.opt.master.bfloat16())
        assert any(not torch.equal(r.detach().bfloat16().float(), r.detach()) for r in ref)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU kernel needs a GPU"))])
def test_compiled_update_equals_eager_update(device):
    torch.set_default_device(device)
    try:
        _compare_update(torch.Generator(device).manual_seed(0))
    finally:
        torch.set_default_device("cpu")


def _compare_update(g):
    n = 3000
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    compiled = torch.compile(adamw_update, dynamic=False, fullgraph=True)
    for skip in (0.0, 1.0, 0.0):
        bufs = [torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g),
                torch.rand(n, generator=g), torch.zeros(n, dtype=torch.bfloat16), torch.tensor(3.0),
                torch.tensor(1e-3), torch.tensor(2.0), torch.tensor(skip)]
        orig_master = bufs[0].clone()
        eager = [b.clone() for b in bufs]
        adamw_update(*eager, **hyper)
        compiled(*bufs, **hyper)
        for a, b in zip(eager, bufs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        # A skipped step leaves the weights as they were; a taken one moves every weight.
        unchanged = int((bufs[0] == orig_master).sum())
        assert unchanged == n if skip else unchanged < n // 100
        assert float(bufs[5]) == 3.0  # the caller counts steps


def test_non_finite_gradients_skip_the_update_and_are_counted():
    tr = _trainer()
    tr.train_step(_batch())
    before = [p.detach().clone() for p in tr.params]
    moments = tr.opt.exp_avg.clone()
    tr.set_lr()
    tr.forward_backward(_batch())
    tr.opt.grad[0] = float("nan")
    tr.optimizer_step()
    for b, p in zip(before, tr.params):
        assert torch.equal(b, p.detach())
    assert torch.equal(moments, tr.opt.exp_avg)
    assert float(tr.opt.step) == 1  # the skipped step does not count for bias correction
    assert tr.stats.pop()["skipped"] == 1
    tr.train_step(_batch())  # the bad gradient is gone: the next step's overwrite it
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, tr.params))
    assert tr.stats.pop()["skipped"] == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_dict_round_trip_resumes_the_same_run(precision):
    a = _trainer(precision=precision)
    for s in range(2):
        a.train_step(_batch(s))
    state = a.state_dict()
    assert all(v.dtype == torch.float32 for v in state["drafter"].values())  # checkpoints hold master weights
    b = _trainer(precision=precision)
    b.train_step(_batch(3))  # another state: everything must come from the checkpoint
    b.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()})
    for name in ("master", "work", "exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(getattr(a.opt, name), getattr(b.opt, name)), name
    torch.manual_seed(5)
    a.train_step(_batch(2))
    torch.manual_seed(5)
    b.train_step(_batch(2))
    assert torch.equal(a.opt.master, b.opt.master)
    with pytest.raises(ValueError, match="checkpoint lacks"):
        b.load_state_dict({"drafter": {}, "optimizer": {}, "step": 0})


def _rank_bf16_step(rank, world_size):
    """One data-parallel step in bf16: each rank its own batch, gradients summed in fp32."""
    import torch.distributed as dist

    tr = _trainer(1.0, "bf16", group=dist.group.WORLD)
    assert tr.opt.world == world_size
    tr.set_lr()
    tr.forward_backward(_batch(rank))
    own = tr.opt.grad.clone()
    tr.opt.allreduce()
    summed = tr.opt._grad().clone()
    tr.optimizer_step()
    return own, summed, tr.opt.master.clone(), float(tr.stats.pop()["gnorm_sum"])


def test_bf16_gradients_are_averaged_in_fp32_across_ranks():
    (g0, s0, m0, n0), (g1, s1, m1, n1) = run_ranks(_rank_bf16_step, 2, timeout=120)
    assert g0.dtype == torch.bfloat16 and s0.dtype == torch.float32
    assert not torch.equal(g0, g1)  # different batches
    expected = g0.float() + g1.float()  # exact in fp32
    assert torch.equal(s0, expected) and torch.equal(s1, expected)
    assert torch.equal(m0, m1)  # every replica took the same step
    mean_norm = float(torch.linalg.vector_norm(expected / 2))
    assert abs(n0 - mean_norm) <= 1e-5 * mean_norm and n0 == n1


def test_update_in_segments_equals_one_update_and_follows_the_forward():
    """Eager mode splits the update per layer (on CUDA, on a side stream); the forward asks for
    each module's weights in the order it runs them."""
    seen = []
    runs = []
    for overlap in (True, False):
        args = DrafterArgs(**{**ARGS, "num_layers": 3})
        torch.manual_seed(0)
        drafter = DFlashDrafter(args)
        obj = DFlashObjective(drafter, args, torch.randn(128, 32) * 0.02, torch.randn(128, 32) * 0.02,
                              DrafterConfig(num_layers=3, block_size=8, num_anchors=8, max_anchors_per_doc=4,
                                            loss_chunk_size=16))
        cfg = TrainConfig(compile="eager", warmup_ratio=0.0, lr=1e-2, weight_decay=0.1, optimizer_overlap=overlap)
        tr = DrafterTrainer(obj, cfg, 10, None, torch.device("cpu"))
        assert len(tr.opt._segments) == (4 if overlap else 1)
        if overlap:
            wait = tr.opt.wait
            drafter.before_module = lambda name: (seen.append(name), wait(name))
        torch.manual_seed(3)
        for step in range(3):
            tr.train_step(_batch(step))
        runs.append((tr.opt.master.clone(), tr.opt.exp_avg_sq.clone(), float(tr.opt.step)))
    assert seen[:5] == ["fc", "hidden_norm", "layers.0", "layers.1", "layers.2"] and seen[5] == "norm"
    assert len(seen) == 3 * 6
    (m1, v1, s1), (m2, v2, s2) = runs
    assert torch.equal(m1, m2) and torch.equal(v1, v2) and s1 == s2 == 3.0


def test_segments_must_be_contiguous_runs_covering_every_parameter():
    ps = [(n, torch.nn.Parameter(torch.randn(4))) for n in ("a", "b", "c")]
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    with pytest.raises(ValueError, match="not a contiguous run"):
        FlatAdamW(ps, segments=[["a", "c"], ["b"]], **kw)
    with pytest.raises(ValueError, match="every trainable parameter once"):
        FlatAdamW(ps, segments=[["a", "b"]], **kw)
    with pytest.raises(ValueError, match="unknown: \\['d'\\]"):
        FlatAdamW(ps, segments=[["a", "b", "c", "d"]], **kw)
    opt = FlatAdamW(ps, segments=[["c"], ["a", "b"]], **kw)
    assert [sorted(names) for names, _ in opt._segments] == [["c"], ["a", "b"]]
    assert opt._segments[0][1][0].data_ptr() == opt.master[8:].data_ptr()


def test_lr_schedule_warms_up_linearly_then_follows_the_cosine_to_its_floor():
    from dflash_mp.trainer import lr_at

    # 11 steps, warm-up ceil(0.25 * 11) = 3 steps, then cosine over the remaining 8 down to 0.1.
    cfg = TrainConfig(lr=1.0, warmup_ratio=0.25, min_lr_ratio=0.1)
    c = 0.5 ** 0.5  # cos(pi/4)
    want = [1 / 3, 2 / 3, 1.0,  # warm-up: (step + 1) / 3
            1.0, 0.1 + 0.45 * (1 + 0.92387953), 0.1 + 0.45 * (1 + c), 0.1 + 0.45 * (1 + 0.38268343),
            0.55,  # half way (progress 4/8): the midpoint of 1.0 and the floor
            0.1 + 0.45 * (1 - 0.38268343), 0.1 + 0.45 * (1 - c), 0.1 + 0.45 * (1 - 0.92387953),
            0.1, 0.1]  # the floor, and it stays there past the last step
    got = [lr_at(s, 11, cfg) for s in range(13)]
    assert got == pytest.approx(want, rel=1e-7)
    # warmup_ratio=0 still warms up for one step (at the full rate), then cosine over the other 4 to 0.
    cfg0 = TrainConfig(lr=2.0, warmup_ratio=0.0, min_lr_ratio=0.0)
    got = [lr_at(s, 5, cfg0) for s in range(6)]
    assert got == pytest.approx([2.0, 2.0, 1.0 + c, 1.0, 1.0 - c, 0.0], abs=1e-12)


def test_trainer_steps_follow_the_schedule():
    tr = _trainer()
    tr.cfg.warmup_ratio, tr.num_steps = 0.3, 4  # warm-up 2 steps, then cosine over 2
    seen = [tr.train_step(_batch(s)) for s in range(4)]
    assert seen == pytest.approx([0.5e-2, 1e-2, 1e-2, 0.5e-2])
    assert tr.opt.lr == pytest.approx(0.5e-2)


def test_gamma_reaches_the_loss_weights():
    import math

    args = DrafterArgs(**ARGS)
    torch.manual_seed(0)
    drafter, embed, head = DFlashDrafter(args), torch.randn(128, 32) * 0.02, torch.randn(128, 32) * 0.02

    def objective(gamma):
        return DFlashObjective(drafter, args, embed, head, DrafterConfig(block_size=8, num_anchors=8,
                               max_anchors_per_doc=4, loss_chunk_size=16, gamma=gamma))

    # Slot 0 (the given anchor token) weighs nothing; slot k >= 1 weighs exp(-(k-1)/gamma).
    for gamma, want in ((2.0, 2.0), (None, 4.0)):  # None: the default for B=8
        weights = objective(gamma).weights.tolist()
        assert weights == pytest.approx([0.0] + [math.exp(-(k - 1) / want) for k in range(1, 8)])
    hb = _batch(0)
    noise = torch.rand(2, hb.input_ids.shape[0], generator=torch.Generator().manual_seed(0))

    def loss(gamma):
        return objective(gamma)(hb.hidden, hb.input_ids, hb.position_ids, hb.doc_ids, hb.loss_mask, noise)[0]

    assert not torch.isclose(loss(2.0), loss(None))


def _rank_overlapped_steps(rank, world_size, overlap):
    """Three data-parallel steps (each rank its own batches), the all-reduce bucketed during backward or
    one collective after it."""
    import torch.distributed as dist

    args = DrafterArgs(**{**ARGS, "num_layers": 3})
    torch.manual_seed(0)
    obj = DFlashObjective(DFlashDrafter(args), args, torch.randn(128, 32) * 0.02, torch.randn(128, 32) * 0.02,
                          DrafterConfig(num_layers=3, block_size=8, num_anchors=8, max_anchors_per_doc=4,
                                        loss_chunk_size=16))
    cfg = TrainConfig(compile="eager", warmup_ratio=0.0, lr=1e-2, weight_decay=0.1, allreduce_overlap=overlap)
    tr = DrafterTrainer(obj, cfg, 10, dist.group.WORLD, torch.device("cpu"))
    torch.manual_seed(3 + rank)
    launched = []
    for step in range(3):
        tr.train_step(_batch(10 * step + rank))
        launched.append(tr.opt.reduced_in_backward)
    return tr.opt.master.clone(), tr.opt.exp_avg_sq.clone(), launched, len(tr.opt._segments)


def test_the_bucketed_all_reduce_during_backward_gives_the_same_steps():
    """2 gloo ranks: with train.allreduce_overlap the 4 buckets (the weights outside the layers, then
    one per layer) are launched from backward's gradient hooks, each once its last gradient is in (the
    layers' while backward still runs the layers before them), and the steps equal those of the one
    collective after backward, bit for bit."""
    on = run_ranks(_rank_overlapped_steps, 2, True, timeout=120)
    off = run_ranks(_rank_overlapped_steps, 2, False, timeout=120)
    (m0, v0, launched, segments), (m1, v1, _, _) = on
    # Last layer first: its sum is under way while backward computes the layers before it.
    assert segments == 4 and launched == [[3, 2, 1, 0]] * 3
    assert torch.equal(m0, m1) and torch.equal(v0, v1)  # the replicas agree
    assert torch.equal(m0, off[0][0]) and torch.equal(v0, off[0][1])
    assert off[0][2] == [[]] * 3  # without the option nothing is launched in backward
