"""target.fuse_mlp (target/fuse.py): the MLP's gate and up projections as one GEMM give the unfused
target's features; MLPs laid out otherwise, or whose forward does more, stay as they are."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from dflash_mp.target import TargetConfig, TargetWorker
from dflash_mp.target.fuse import fuse_mlp, mlp_fusable
from test_target import packed
from test_target_varlen import tiny_qwen3

CPU = torch.device("cpu")


def _worker(model, fuse: bool) -> TargetWorker:
    model.config._attn_implementation = "sdpa"
    return TargetWorker(model, [1, 2, 3], CPU, fuse_mlp=fuse)


def test_the_job_fuses_the_mlps_by_default():
    assert TargetConfig().fuse_mlp is True


def test_a_fused_target_gives_the_unfused_features():
    model = tiny_qwen3(CPU, torch.float32)
    plain = _worker(copy.deepcopy(model), False)
    fused = _worker(model, True)
    assert sorted(fused.fused) == [0, 1, 2, 3] and plain.fused == {}
    mlp = model.model.layers[2].mlp
    assert type(mlp).__name__ == "FusedQwen3MLP" and mlp.gate_up_weight.shape == (128, 32)
    # gate and up are views of the fused weight: nothing duplicated, the values as loaded
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()
    assert torch.equal(mlp.up_proj.weight, plain.model.model.layers[2].mlp.up_proj.weight)
    batch = packed([70, 50, 8], 128)
    want, got = plain.forward(batch).hidden, fused.forward(batch).hidden
    assert got.shape == want.shape == (128, 3 * 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fused.fused_how == "gate/up as one GEMM (4 of 4 layers)"
    assert plain.fused_how == "no (target.fuse_mlp=false)"
    # another worker over the same model, unfused: the MLPs' own forward again
    again = _worker(model, False)
    assert type(mlp).__name__ == "Qwen3MLP" and "gate_up_weight" not in dict(mlp.named_buffers())
    torch.testing.assert_close(again.forward(batch).hidden, want, rtol=1e-5, atol=1e-5)


class _Doubled(nn.Module):
    """An MLP laid out like Llama's whose forward does more than its modules say."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

    def forward(self, x):
        return 2 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_an_mlp_whose_forward_differs_keeps_its_own(caplog):
    model = tiny_qwen3(CPU, torch.float32)
    model.model.layers[1].mlp = _Doubled(model.model.layers[1].mlp)
    plain = _worker(copy.deepcopy(model), False)
    with caplog.at_level(logging.WARNING):
        fused = _worker(model, True)
    assert sorted(fused.fused) == [0, 2, 3] and type(model.model.layers[1].mlp) is _Doubled
    assert "layer 1 with its MLP fused differs from its own forward" in caplog.text
    batch = packed([100, 28], 128)
    torch.testing.assert_close(fused.forward(batch).hidden, plain.forward(batch).hidden, rtol=1e-5, atol=1e-5)


def test_only_llama_style_mlps_are_fused():
    model = tiny_qwen3(CPU, torch.float32)
    assert mlp_fusable(model.model.layers[0].mlp)
    biased = nn.Module()
    biased.gate_proj, biased.up_proj, biased.down_proj = (nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8))
    biased.act_fn = torch.nn.functional.silu
    assert not mlp_fusable(biased)
    moe = nn.Module()
    moe.mlp = nn.Module()  # experts, not gate/up/down
    assert fuse_mlp(moe) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fused_graphed_target_on_a_gpu_gives_the_unfused_features():
    """bf16, head_dim 128, the Triton attention, compiled layers replayed as a CUDA graph: the fused
    target's features equal the unfused one's to bf16 rounding, row after row."""
    cuda = torch.device("cuda")
    model = tiny_qwen3(cuda, torch.bfloat16, 300, head_dim=128)
    model.config._attn_implementation = "triton"
    rows = [packed([300, 520, 130], 1024, 96), packed([100, 400, 60, 250, 200], 1024, 96, seed=1)]
    plain = TargetWorker(copy.deepcopy(model), [1, 2, 3], cuda, compile=True, cuda_graph=True)
    fused = TargetWorker(model, [1, 2, 3], cuda, compile=True, cuda_graph=True, fuse_mlp=True)
    assert sorted(fused.fused) == [0, 1, 2, 3], fused.fused_how
    for pb in rows + rows:
        want, got = plain.forward(pb).hidden, fused.forward(pb).hidden
        n = pb.num_valid_tokens
        rel = float(((got[:n] - want[:n]).float().norm(dim=-1) / want[:n].float().norm(dim=-1)).max())
        assert rel < 1e-2, rel
    assert fused.graph.failed is None and fused.graph.replays == 3
