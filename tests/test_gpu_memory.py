"""A built drafter trainer gives back what its build left in the CUDA allocator's cache (the parameters'
first fp32 tensors, copied into the optimizer's flat buffers; the target head's fp32 draw): kept, it is
memory a target sharing the GPU cannot have, and the first steps' activations are laid out beside it."""

import pytest
import torch

from dflash_mp.gpu_memory import give_back_cached, memory_scalars
from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.trainer import DFlashObjective, DrafterConfig, DrafterTrainer, TrainConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def idle_bytes() -> int:
    """Reserved but not allocated: the allocator's cache."""
    return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def test_give_back_returns_the_freed_blocks_and_the_figures_count_them():
    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    x = torch.empty(64 * 2**20, dtype=torch.float32, device=dev)  # 256 MiB
    del x
    assert idle_bytes() >= 256 * 2**20
    assert memory_scalars(dev)["memory/max_reserved_gib"] >= 0.25
    assert give_back_cached(dev, "test") >= 256 * 2**20
    assert idle_bytes() < 256 * 2**20


def test_a_built_drafter_trainer_leaves_no_fp32_parameters_in_the_cache():
    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    idle0 = idle_bytes()
    args = DrafterArgs(hidden_size=1024, intermediate_size=4096, num_layers=4, num_heads=8, num_kv_heads=2,
                       head_dim=128, vocab_size=8192, target_layer_ids=[1, 2, 3], block_size=16,
                       mask_token_id=8191)
    torch.manual_seed(0)
    with torch.device(dev):
        drafter = DFlashDrafter(args)
    fp32 = sum(p.numel() * 4 for p in drafter.parameters())
    # As random_target_head draws a random target's: in fp32, then cast.
    embed = torch.empty(8192, 1024, device=dev).normal_(0.0, 0.02).bfloat16()
    head = torch.empty(8192, 1024, device=dev).normal_(0.0, 0.02).bfloat16()
    cfg = DrafterConfig(num_layers=4, block_size=16, num_anchors=64, max_anchors_per_doc=64,
                        loss_chunk_size=512)
    obj = DFlashObjective(drafter, args, embed, head, cfg)
    DrafterTrainer(obj, TrainConfig(warmup_ratio=0.0), 100, None, dev)
    idle = idle_bytes() - idle0
    print(f"\nfp32 parameters {fp32 / 2**20:.0f} MiB; cached after the build {idle / 2**20:.1f} MiB")
    assert idle < fp32 // 4, (idle, fp32)
