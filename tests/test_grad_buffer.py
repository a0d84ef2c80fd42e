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
