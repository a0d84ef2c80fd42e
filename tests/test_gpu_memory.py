"""What building a role and resuming one leave on the GPU. A built drafter trainer gives back what its
build left in the CUDA allocator's cache (the parameters' first fp32 tensors, copied into the optimizer's
flat buffers; the target head's fp32 draw): kept, it is memory a target sharing the GPU cannot have, and
the first steps' activations are laid out beside it. A random target loads within its weights and one
layer in fp32; a resume copies the checkpoint in from host memory."""

import gc

import pytest
import torch

from dflash_mp import optim as optim_module
from dflash_mp import trainer as trainer_module
from dflash_mp.gpu_memory import give_back_cached, memory_scalars
from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.target.weights import random_target_head
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


def _built_trainer_cache(scratch_mib: int = 0) -> tuple[int, int]:
    """(bytes of the drafter's fp32 parameters, bytes the allocator caches once the trainer is built).
    `scratch_mib`: a temporary of that size freed just before the build, left in the allocator's cache."""
    dev = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    idle0 = idle_bytes()
    args = DrafterArgs(hidden_size=2048, intermediate_size=8192, num_layers=4, num_heads=16, num_kv_heads=4,
                       head_dim=128, vocab_size=8192, target_layer_ids=[1, 2, 3], block_size=16,
                       mask_token_id=8191)
    torch.manual_seed(0)
    with torch.device(dev):
        drafter = DFlashDrafter(args)
    fp32 = sum(p.numel() * 4 for p in drafter.parameters())
    embed, head = random_target_head({"vocab_size": 8192, "hidden_size": 2048}, 0, dev, torch.bfloat16)
    if scratch_mib:  # made and freed at once: its block stays in the cache
        torch.empty(scratch_mib * 2**20, dtype=torch.uint8, device=dev)
    cfg = DrafterConfig(num_layers=4, block_size=16, num_anchors=64, max_anchors_per_doc=64,
                        loss_chunk_size=512)
    tr = DrafterTrainer(DFlashObjective(drafter, args, embed, head, cfg), TrainConfig(warmup_ratio=0.0), 100,
                        None, dev)
    idle = idle_bytes() - idle0
    del tr, drafter, embed, head
    return fp32, idle


def test_a_built_drafter_trainer_gives_back_its_fp32_parameters(monkeypatch):
    monkeypatch.setattr(trainer_module, "give_back_cached", lambda device, what: 0)
    fp32, kept = _built_trainer_cache()
    monkeypatch.undo()
    _, given = _built_trainer_cache()
    print(f"\nfp32 parameters {fp32 / 2**20:.0f} MiB; cached after the build {kept / 2**20:.0f} MiB kept, "
          f"{given / 2**20:.0f} MiB given back")
    assert kept - given >= fp32 * 3 // 4, (fp32, kept, given)


def test_the_optimizer_state_is_never_carved_out_of_a_freed_temporary(monkeypatch):
    """A block a temporary left cached (700 MiB here; a 27B random head's fp32 draw is 4.7 GiB) must not
    hold the optimizer's flat buffers: the rest of its segment would stay reserved, out of the give-back's
    reach (5.4 GiB at 27B shapes on an H100, R5)."""
    _, plain = _built_trainer_cache()
    monkeypatch.setattr(optim_module, "fresh_segments", lambda device: None)
    _, carved = _built_trainer_cache(scratch_mib=700)
    monkeypatch.undo()
    _, fresh = _built_trainer_cache(scratch_mib=700)
    print(f"\ncached after the build: {plain / 2**20:.0f} MiB; after a 700 MiB temporary "
          f"{carved / 2**20:.0f} MiB with the buffers carved out of it, {fresh / 2**20:.0f} MiB in segments "
          "of their own")
    assert carved >= plain + 128 * 2**20, (plain, carved)  # the case the fix is for happens here
    assert fresh <= plain + 32 * 2**20, (plain, fresh)


@pytest.mark.parametrize("layers", [None, (2, 8)], ids=["whole", "later_stage"])
def test_a_random_target_loads_within_its_weights_and_one_layer_in_fp32(tmp_path, layers):
    """The whole target (a first stage: the embedding drawn in fp32 and cast) and a later stage of it
    (no embedding kept) peak at their weights and about one layer in fp32."""
    from dflash_mp.builtin.chats import demo_texts
    from dflash_mp.builtin.targets import build_demo_tokenizer, build_random_target
    from dflash_mp.target import TargetWorker

    sizes = dict(vocab_size=65536, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=128)
    path = build_random_target(str(tmp_path / "target"), build_demo_tokenizer(demo_texts()), **sizes)
    dev = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    worker = TargetWorker.load(path, [1, 7], dev, torch.bfloat16, layers=layers)
    peak = torch.cuda.max_memory_allocated() - base
    weights = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    kept = [m for m in worker.model.get_decoder().layers if sum(1 for _ in m.parameters())]
    layer_fp32 = sum(p.numel() * 4 for p in kept[0].parameters())
    print(f"\n{layers or 'whole'}: weights {weights / 2**20:.0f} MiB, a layer in fp32 "
          f"{layer_fp32 / 2**20:.0f} MiB, the load's peak {peak / 2**20:.0f} MiB")
    # On an H100: the whole load peaked at 1312 MiB (bound 1474), the later stage at 824 (bound 986). A later
    # stage holding the embedding it drops beside its layers peaked at 1080; holding the shell's head and
    # layer too, at 1452; the whole load then failed the bound as well.
    assert peak < weights + 5 * layer_fp32 // 4, (peak, weights, layer_fp32)


def _resume_into_a_cuda_trainer(rank, world, root):
    """Train a step and checkpoint it; build a second trainer and resume it there: its weights and
    moments equal the first's, and the load's peak stays far under the state's 12 bytes a parameter."""
    import torch.distributed as dist

    from dflash_mp import checkpoint as ckpt
    from dflash_mp.batch import HiddenBatch

    dev = torch.device("cuda")
    args = DrafterArgs(hidden_size=1024, intermediate_size=4096, num_layers=4, num_heads=8, num_kv_heads=2,
                       head_dim=128, vocab_size=8192, target_layer_ids=[1, 2, 3], block_size=16,
                       mask_token_id=8191)
    cfg = DrafterConfig(num_layers=4, block_size=16, num_anchors=64, max_anchors_per_doc=64,
                        loss_chunk_size=512)

    def trainer(seed: int) -> DrafterTrainer:
        torch.manual_seed(seed)
        with torch.device(dev):
            drafter = DFlashDrafter(args)
        embed = torch.randn(8192, 1024, device=dev).bfloat16()
        obj = DFlashObjective(drafter, args, embed, embed, cfg)
        return DrafterTrainer(obj, TrainConfig(compile="eager", warmup_ratio=0.0), 100, None, dev)

    first = trainer(0)
    n = 1024
    g = torch.Generator(dev).manual_seed(0)
    hb = HiddenBatch(hidden=torch.randn(n, 3 * 1024, generator=g, device=dev).bfloat16(),
                     input_ids=torch.randint(0, 8191, (n,), generator=g, device=dev),
                     position_ids=torch.arange(n, device=dev),
                     doc_ids=torch.zeros(n, dtype=torch.long, device=dev),
                     loss_mask=torch.ones(n, dtype=torch.long, device=dev), num_valid_tokens=n)
    first.train_step(hb)
    first.opt.wait_all()
    cp = ckpt.Checkpointer(root, rank, True, dist.group.WORLD, keep=1, manifest={"world_size": world})
    cp.save(first, 1, 100, wait=True)
    second = trainer(1)
    state_bytes = 12 * sum(p.numel() for p in second.params)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step = cp.load(cp.resolve("auto")[1], second)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    same = all(torch.equal(getattr(first.opt, k), getattr(second.opt, k))
               for k in ("master", "exp_avg", "exp_avg_sq", "step"))
    return {"step": step, "same": same, "peak": peak, "state_bytes": state_bytes}


def test_a_resume_copies_the_checkpoint_in_a_tensor_at_a_time(tmp_path):
    from dist_utils import run_ranks

    got = run_ranks(_resume_into_a_cuda_trainer, 1, str(tmp_path), timeout=300, start_method="spawn")[0]
    print(f"\nload peak {got['peak'] / 2**20:.0f} MiB over what the trainer held; the state "
          f"{got['state_bytes'] / 2**20:.0f} MiB")
    assert got["step"] == 1 and got["same"], got
    assert got["peak"] < got["state_bytes"] // 4, got
