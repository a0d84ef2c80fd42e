"""target.fuse (target/fuse.py): the MLP's gate/up projections as one GEMM and the residual added in
the down projection give the unfused target's features; modules laid out otherwise stay as they are."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from dflash_mp.target import TargetConfig, TargetWorker
from dflash_mp.target.fuse import fuse_module, layer_fusable, mlp_fusable
from test_target import packed
from test_target_varlen import tiny_qwen3

CPU = torch.device("cpu")


def _worker(model, fuse: str) -> TargetWorker:
    model.config._attn_implementation = "sdpa"
    return TargetWorker(model, [1, 2, 3], CPU, fuse=fuse)


@pytest.mark.parametrize("level", ["layer", "mlp-residual", "mlp"])
def test_a_fused_target_gives_the_unfused_features(level):
    model = tiny_qwen3(CPU, torch.float32)
    plain = _worker(copy.deepcopy(model), "none")
    fused = _worker(model, level)
    assert sorted(fused.fused) == [0, 1, 2, 3] and plain.fused == {}
    layer = model.model.layers[2]
    kind = type(layer) if level != "mlp" else type(layer.mlp)
    assert kind.__name__.startswith("Fused") and layer.mlp.gate_up_weight.shape == (128, 32)
    assert hasattr(layer.self_attn, "qkv_weight") == (level == "layer")
    # gate and up are views of the fused weight: nothing duplicated, the same values as loaded
    assert layer.mlp.gate_proj.weight.data_ptr() == layer.mlp.gate_up_weight.data_ptr()
    assert torch.equal(layer.mlp.up_proj.weight, plain.model.model.layers[2].mlp.up_proj.weight)
    batch = packed([70, 50, 8], 128)
    want, got = plain.forward(batch).hidden, fused.forward(batch).hidden
    assert got.shape == want.shape == (128, 3 * 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "gate/up as one GEMM" in fused.fused_how and "4 of 4 layers" in fused.fused_how
    assert ("down_proj" in fused.fused_how) == (level != "mlp")
    assert ("q/k/v" in fused.fused_how) == (level == "layer")


def test_the_job_fuses_whole_layers_by_default():
    assert TargetConfig().fuse == "layer"


def test_a_bad_level_names_the_choices():
    with pytest.raises(ValueError, match="target.fuse='gate'.*layer, mlp-residual, mlp, none"):
        _worker(tiny_qwen3(CPU, torch.float32), "gate")


class _Doubled(nn.Module):
    """An MLP laid out like Llama's whose forward does more than its modules say."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

    def forward(self, x):
        return 2 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_a_layer_whose_forward_differs_keeps_its_own(caplog):
    model = tiny_qwen3(CPU, torch.float32)
    model.model.layers[1].mlp = _Doubled(model.model.layers[1].mlp)
    plain = _worker(copy.deepcopy(model), "none")
    with caplog.at_level(logging.WARNING):
        fused = _worker(model, "mlp")
    assert sorted(fused.fused) == [0, 2, 3] and type(model.model.layers[1].mlp) is _Doubled
    assert "layer 1 fused (target.fuse=mlp) differs from its own forward" in caplog.text
    batch = packed([100, 28], 128)
    torch.testing.assert_close(fused.forward(batch).hidden, plain.forward(batch).hidden, rtol=1e-5, atol=1e-5)


def test_only_llama_style_modules_are_fused():
    model = tiny_qwen3(CPU, torch.float32)
    layer = model.model.layers[0]
    assert layer_fusable(layer) and mlp_fusable(layer.mlp)
    layer.extra_norm = nn.LayerNorm(32)  # Gemma-like: more norms than Llama's layer
    assert not layer_fusable(layer) and fuse_module(layer, "layer") is layer.mlp  # the MLP alone
    biased = nn.Module()
    biased.gate_proj, biased.up_proj, biased.down_proj = (nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8))
    biased.act_fn = torch.nn.functional.silu
    assert not mlp_fusable(biased)
    moe = nn.Module()
    moe.mlp = nn.Module()  # experts, not gate/up/down
    assert fuse_module(moe, "layer") is None


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
    fused = TargetWorker(model, [1, 2, 3], cuda, compile=True, cuda_graph=True, fuse="layer")
    assert sorted(fused.fused) == [0, 1, 2, 3], fused.fused_how
    for pb in rows + rows:
        want, got = plain.forward(pb).hidden, fused.forward(pb).hidden
        n = pb.num_valid_tokens
        rel = float(((got[:n] - want[:n]).float().norm(dim=-1) / want[:n].float().norm(dim=-1)).max())
        assert rel < 1e-2, rel
    assert fused.graph.failed is None and fused.graph.replays == 3


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_and_qwen2_layers_fuse_whole(family):
    """Llama (no q/k norms, no sliding_window passed) and Qwen2 (q/k/v biases) fuse at `layer`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = LlamaConfig if family == "llama" else Qwen2Config
    cfg = cls(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.requires_grad_(False)
    for layer in model.model.layers:  # non-zero biases, so a dropped one shows
        for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            if p.bias is not None:
                p.bias.normal_()
    plain = _worker(copy.deepcopy(model), "none")
    fused = _worker(model, "layer")
    assert sorted(fused.fused) == [0, 1, 2, 3] and "q/k/v" in fused.fused_how
    assert (model.model.layers[0].self_attn.qkv_bias is None) == (family == "llama")
    batch = packed([70, 50, 8], 128)
    torch.testing.assert_close(fused.forward(batch).hidden, plain.forward(batch).hidden, rtol=1e-5, atol=1e-5)
