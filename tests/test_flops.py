"""The FLOP model (flops.py) against what the models compute: transformers' own layers, their matmuls
counted by torch's FLOP counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from dflash_mp.archs import TINY_ARCHS, hf_config, known_target_config
from dflash_mp.flops import layer_forward_flops
from dflash_mp.target.spec import text_config_dict

_DENSE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
              num_hidden_layers=2)
ARCHS = {"llama": dict(model_type="llama", **_DENSE), "qwen3": dict(model_type="qwen3", **_DENSE),
         "qwen3.5 (linear and gated full attention)": TINY_ARCHS["tiny-qwen3.5"],
         "qwen3-moe (routed experts)": TINY_ARCHS["tiny-qwen3-moe"],
         "qwen3.5-moe (hybrid, routed and shared experts)": TINY_ARCHS["tiny-qwen3.5-moe"]}


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_each_layer_s_projections_are_the_matmuls_the_model_runs(name):
    """Per decoder layer, the formula with no attention pairs (and, for a linear-attention layer, less its
    recurrence) equals the FLOPs of the layer's matrix multiplies in a forward of T tokens: q/k/v/o (the
    gated attention's q_proj twice as wide), the MLP, Gated DeltaNet's projections; in a MoE layer the
    router, the experts each token is routed to and the shared expert with its gate. The experts run
    one by one (`experts_implementation="eager"`): torch's counter sees no FLOPs in the grouped matmul
    transformers runs them with by default. A full-attention layer's attention term, at the T * T pairs
    eager attention scores, equals its batched matmuls (QK^T and PV)."""
    cfg = hf_config(ARCHS[name], vocab_size=96)
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    except TypeError:  # a transformers without the choice runs its experts one by one
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    T = 64
    with FlopCounterMode(display=False) as counter:  # the module tracker needs autograd on: no no_grad
        model.model(torch.randint(0, 96, (1, T)))
    counts = counter.get_flop_counts()
    config = text_config_dict(cfg.to_dict())
    kinds = config.get("layer_types") or ["full_attention"] * cfg.num_hidden_layers
    for i, kind in enumerate(kinds):
        layer = next(v for k, v in counts.items() if k.endswith(f"layers.{i}"))
        matmuls = sum(v for op, v in layer.items() if str(op).split(".")[1] in ("mm", "addmm"))
        want = layer_forward_flops(config, i, T, 0.0)
        if kind == "linear_attention":
            want -= T * 4 * config["linear_num_value_heads"] * config["linear_key_head_dim"] * \
                config["linear_value_head_dim"]
        assert matmuls == want, (name, i, kind, matmuls, want)
        if kind == "full_attention":  # eager attention scores every (query, key) pair: T * T of them
            scores = sum(v for op, v in layer.items() if str(op).split(".")[1] == "bmm")
            assert scores == layer_forward_flops(config, i, T, float(T * T)) - want, (name, i, scores)


def test_the_planner_knows_qwen3_5_as_the_hybrid_it_is():
    """`python -m dflash_mp.plan` reads a known hub id's shapes from archs: for Qwen3.5-27B the whole
    architecture (3 of 4 layers linear attention, gated full attention), as the run reads its config."""
    config = known_target_config("Qwen/Qwen3.5-27B")
    assert config["layer_types"].count("linear_attention") == 48 and config["model_type"] == "qwen3_5_text"
    assert "tokenizer_len" not in config and known_target_config("Qwen/Qwen3-8B")["hidden_size"] == 4096
