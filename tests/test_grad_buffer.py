"""Gradients live in one flat buffer the trainer owns (CUDA graphs must never hand `.grad` their pool)."""

import sys
from pathlib import Path

import torch

from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.trainer import DFlashObjective, DrafterConfig, DrafterTrainer, TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import synthetic_batch  # noqa: E402


def test_grads_are_views_of_one_buffer_that_steps_reuse():
    args = DrafterArgs(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       vocab_size=128, target_layer_ids=[1, 2], block_size=8, mask_token_id=127)
    torch.manual_seed(0)
    drafter = DFlashDrafter(args)
    embed, head = torch.randn(128, 32) * 0.02, torch.randn(128, 32) * 0.02
    obj = DFlashObjective(drafter, args, embed, head, DrafterConfig(block_size=8, num_anchors=8, max_anchors_per_doc=4,
                                                                    loss_chunk_size=16))
    tr = DrafterTrainer(obj, TrainConfig(compile="eager", warmup_ratio=0.0), 10, None, torch.device("cpu"))
    flat = tr.grads.flat
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    ptrs = [p.grad.data_ptr() for p in tr.params]
    assert all(lo <= q < hi for q in ptrs) and len(set(ptrs)) == len(ptrs)
    batch = synthetic_batch(64, 2 * 32, 128, "cpu", torch.float32, seed=0, lo=16, hi=40)
    tr.set_lr()
    tr.forward_backward(batch)
    assert flat.abs().sum() > 0  # backward accumulated into the buffer, not into fresh tensors
    assert [p.grad.data_ptr() for p in tr.params] == ptrs
    tr.optimizer_step()
    assert flat.abs().sum() == 0  # zeroed for the next step, still the same memory
    tr.train_step(batch)
    assert [p.grad.data_ptr() for p in tr.params] == ptrs


def _trainer(grad_clip: float = 1.0) -> DrafterTrainer:
    args = DrafterArgs(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       vocab_size=128, target_layer_ids=[1, 2], block_size=8, mask_token_id=127)
    torch.manual_seed(0)
    obj = DFlashObjective(DFlashDrafter(args), args, torch.randn(128, 32) * 0.02, torch.randn(128, 32) * 0.02,
                          DrafterConfig(block_size=8, num_anchors=8, max_anchors_per_doc=4, loss_chunk_size=16))
    cfg = TrainConfig(compile="eager", warmup_ratio=0.0, lr=1e-2, grad_clip=grad_clip, weight_decay=0.1)
    return DrafterTrainer(obj, cfg, 10, None, torch.device("cpu"))


def test_clip_folded_into_fused_adamw_matches_clip_grad_norm_then_adamw():
    batch = synthetic_batch(64, 2 * 32, 128, "cpu", torch.float32, seed=0, lo=16, hi=40)
    for clip in (1e-3, 1e6, 0.0):  # clipping bites / never bites / disabled
        tr = _trainer(clip)
        ref = [torch.nn.Parameter(p.detach().clone()) for p in tr.params]
        init = [p.detach().clone() for p in tr.params]
        tr.set_lr()
        tr.forward_backward(batch)
        for r, p in zip(ref, tr.params):
            r.grad = p.grad.detach().clone()
        norm = torch.nn.utils.clip_grad_norm_(ref, clip) if clip > 0 else None
        torch.optim.AdamW(ref, lr=tr.opt.param_groups[0]["lr"], betas=tr.cfg.betas, weight_decay=0.1,
                          foreach=False).step()
        tr.optimizer_step()
        assert sum(float((p.detach() - i).abs().sum()) for p, i in zip(tr.params, init)) > 0
        for r, p in zip(ref, tr.params):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-7)
        stats = tr.stats.pop()
        if norm is not None:
            torch.testing.assert_close(stats["gnorm_sum"].float(), norm, rtol=1e-5, atol=0)
        assert stats["skipped"] == 0


def test_non_finite_gradients_skip_the_update_and_are_counted():
    batch = synthetic_batch(64, 2 * 32, 128, "cpu", torch.float32, seed=0, lo=16, hi=40)
    tr = _trainer()
    tr.train_step(batch)
    before = [p.detach().clone() for p in tr.params]
    moments = [tr.opt.state[p]["exp_avg"].clone() for p in tr.params]
    tr.set_lr()
    tr.forward_backward(batch)
    tr.params[0].grad[0, 0] = float("nan")
    tr.optimizer_step()
    for b, p, m in zip(before, tr.params, moments):
        assert torch.equal(b, p.detach())
        assert torch.equal(m, tr.opt.state[p]["exp_avg"])
    assert float(tr.opt.state[tr.params[0]]["step"]) == 1  # the skipped step does not count for bias correction
    assert tr.stats.pop()["skipped"] == 1
    assert float(tr.grads.flat.abs().sum()) == 0  # the bad gradient is gone: the next step starts clean
    tr.train_step(batch)
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, tr.params))
    assert tr.stats.pop()["skipped"] == 0
