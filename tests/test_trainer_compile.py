"""Compiled drafter steps equal eager ones (same anchors: their noise is drawn outside the graph).
CUDA only: on CPU, inductor's C++ compile of even a tiny step costs about a minute per variant."""

import sys
from pathlib import Path

import pytest
import torch

from dflash_mp.compile_stats import counts
from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.trainer import DFlashObjective, DrafterConfig, DrafterTrainer, TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import synthetic_batch  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled steps are checked on CUDA")]


def build(mode: str, scope: str, loss: str = "eager", overlap: bool = True, direct: bool = True,
          clip: float = 1.0, graph: bool = False, block: int = 8) -> DrafterTrainer:
    """`graph`: train.cuda_graph (off here unless a test is about it: the others check launched steps);
    `block`: the block size (16 or more runs the Triton block kernels, 8 flex_attention)."""
    dev = torch.device("cuda")
    args = DrafterArgs(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=64, vocab_size=1024, target_layer_ids=[1, 2, 3], block_size=block, mask_token_id=1023)
    torch.manual_seed(0)
    with torch.device(dev):
        d = DFlashDrafter(args)
    g = torch.Generator(dev).manual_seed(1)
    embed = (torch.randn(1024, 256, generator=g, device=dev) * 0.02).bfloat16()
    head = (torch.randn(1024, 256, generator=g, device=dev) * 0.02).bfloat16()
    obj = DFlashObjective(d, args, embed, head, DrafterConfig(block_size=block, num_anchors=64, max_anchors_per_doc=16,
                                                              loss_chunk_size=256))
    cfg = TrainConfig(compile=mode, compile_scope=scope, loss_kernel=loss, warmup_ratio=0.0,
                      optimizer_overlap=overlap, grad_clip=clip, cuda_graph=graph)
    return DrafterTrainer(obj, cfg, 100, None, dev, direct_grads=direct)


@pytest.mark.parametrize("mode,scope,loss", [("default", "step", "eager"), ("reduce-overhead", "step", "eager"),
                                             ("reduce-overhead", "layers", "triton"), ("default", "layers", "inductor"),
                                             ("default", "layers", "triton")])
def test_compiled_losses_match_eager_and_never_recompile(mode, scope, loss):
    batches = [synthetic_batch(512, 3 * 256, 1024, "cuda", torch.bfloat16, seed=s, lo=64, hi=300) for s in range(3)]

    def curve(tr):
        torch.manual_seed(7)
        out = []
        for i in range(12):
            tr.set_lr()
            out.append(tr.forward_backward(batches[i % 3]).item())
            tr.optimizer_step()
            if i == 3:
                warm = counts()
        after = counts()
        return out, after["graphs"] - warm["graphs"], after["cudagraph_records"] - warm["cudagraph_records"]

    ref, _, _ = curve(build("eager", "step"))
    got, recompiles, rerecords = curve(build(mode, scope, loss))
    assert recompiles == 0 and rerecords == 0
    for a, b in zip(ref, got):
        assert abs(a - b) <= 2e-2 * abs(a), (ref, got)  # bf16 tolerance


@pytest.mark.parametrize("mode,loss", [("eager", "eager"), ("default", "inductor"), ("default", "triton")])
def test_training_step_never_synchronises_the_gpu(mode, loss):
    """Between logging intervals the step queues work and returns: any device->host sync raises."""
    tr = build(mode, "layers", loss)
    batch = synthetic_batch(512, 3 * 256, 1024, "cuda", torch.bfloat16, seed=0, lo=64, hi=300)
    for _ in range(3):  # compile and warm up outside the check
        tr.train_step(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            tr.train_step(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_cuda_graphs_keep_the_update_on_the_compute_stream():
    assert not build("reduce-overhead", "layers", "triton").opt.on_side_stream
    assert build("default", "layers", "triton").opt.on_side_stream
    assert not build("default", "layers", "triton", graph=True, block=16).opt.on_side_stream  # captured step


def test_cuda_graphs_keep_the_flat_gradient_buffer():
    """`.grad` may live in a CUDA graph's output pool, which the next replay overwrites."""
    tr = build("reduce-overhead", "layers", "triton")
    assert not tr.opt.direct and tr.opt.grad is not None
    assert build("default", "layers", "triton").opt.direct


@pytest.mark.parametrize("mode", ["eager", "default"])
def test_updates_reading_grad_on_a_side_stream_equal_the_flat_buffers(mode):
    """The direct scheme's `.grad` tensors outlive backward until the side stream's update has read
    them: steps queued back to back give the flat scheme's weights (no clipping: the same divisor),
    and the compiled per-parameter update compiles once for the identical layers."""
    batches = [synthetic_batch(512, 3 * 256, 1024, "cuda", torch.bfloat16, seed=s, lo=64, hi=300) for s in range(3)]
    runs = []
    for direct in (True, False):
        tr = build(mode, "layers", "triton", direct=direct, clip=0.0)
        assert tr.opt.direct == direct and tr.opt.on_side_stream
        torch.manual_seed(7)
        losses = []
        for i in range(8):  # no host sync in between: the streams race as in training
            tr.train_step(batches[i % 3])
            losses.append(tr.stats.loss.clone())
            if i == 1:
                warm = counts()["graphs"]
        assert counts()["graphs"] == warm
        runs.append(([float(x) for x in losses], tr.opt.named_master(), tr.opt.exp_avg_sq.clone()))
    (l1, m1, v1), (l2, m2, v2) = runs
    assert l1 == pytest.approx(l2, rel=1e-3)
    torch.testing.assert_close(v1, v2, rtol=1e-3, atol=1e-12)
    for name in m1:
        torch.testing.assert_close(m1[name], m2[name], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "default"])
def test_updates_on_a_side_stream_give_the_same_weights(mode):
    """Each layer's update overlaps the next forward; every layer still reads its updated weights."""
    batches = [synthetic_batch(512, 3 * 256, 1024, "cuda", torch.bfloat16, seed=s, lo=64, hi=300) for s in range(3)]
    runs = []
    for overlap in (True, False):
        tr = build(mode, "layers", "triton", overlap=overlap)
        assert tr.opt.on_side_stream == overlap and len(tr.opt._segments) == (3 if overlap else 1)
        torch.manual_seed(7)
        losses = []
        for i in range(6):  # no host sync in between: the streams race as in training
            tr.train_step(batches[i % 3])
            losses.append(tr.stats.loss.clone())
        runs.append(([float(x) for x in losses], tr.opt.named_master(), tr.opt.exp_avg_sq.clone()))
    (l1, m1, v1), (l2, m2, v2) = runs
    assert l1 == l2
    assert torch.equal(v1, v2)
    for name in m1:
        assert torch.equal(m1[name], m2[name]), name


@pytest.mark.parametrize("mode", ["eager", "default"])
def test_the_step_replayed_as_a_cuda_graph_equals_the_launched_one(mode):
    """Captured at step 3, replayed from then on: every step's loss, the weights, the moments and the
    interval's sums equal those of steps launched one by one (the random anchors included: the graph
    draws from the generator's graph-safe state), with no host sync and no recompile in the replays."""
    batches = [synthetic_batch(512, 3 * 256, 1024, "cuda", torch.bfloat16, seed=s, lo=64, hi=300) for s in range(3)]
    runs = []
    for graph in (True, False):
        tr = build(mode, "layers", "triton", overlap=False, graph=graph, block=16)
        assert tr.objective.attention == "triton" and (tr.graph is not None) == graph, tr.describe_graph()
        assert not tr.opt.on_side_stream
        torch.manual_seed(7)
        losses = []
        try:
            for i in range(7):
                if i == 4:  # captured at step 3: from here on only replays (or launched steps)
                    torch.cuda.synchronize()
                    warm = counts()["graphs"]
                    torch.cuda.set_sync_debug_mode("error")
                tr.train_step(batches[i % 3])
                losses.append(tr.stats.loss.clone())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert counts()["graphs"] == warm
        if graph:
            assert tr.graph.replays == 5 and tr.describe_graph().startswith("on"), tr.describe_graph()
        stats = tr.stats.pop()
        runs.append(([float(x) for x in losses], tr.opt.named_master(), tr.opt.exp_avg_sq.clone(), stats,
                     tr.step, float(tr.opt.step)))
    (l1, m1, v1, s1, n1, k1), (l2, m2, v2, s2, n2, k2) = runs
    assert l1 == l2 and n1 == n2 == 7 and k1 == k2 == 7.0
    assert s1["steps"] == s2["steps"] == 7 and s1["valid_tokens"] == s2["valid_tokens"] > 0
    for key in ("loss_sum", "gnorm_sum", "tau_sum", "blocks", "slot_correct_3"):
        assert float(s1[key]) == float(s2[key]), key
    assert torch.equal(v1, v2)
    for name in m1:
        assert torch.equal(m1[name], m2[name]), name
