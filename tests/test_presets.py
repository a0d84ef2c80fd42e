"""Every experiment preset composes and validates against its target's architecture, with no weights."""

import pytest
import torch

from dflash_mp.config import compose
from dflash_mp.runtime import validate
from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.archs import TARGET_ARCHS, known_target_config
from dflash_mp.split import job_workload
from dflash_mp.target import TargetSpec
from dflash_mp.trainer import build_drafter_args


class FakeTokenizer:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def analytic_params(a: DrafterArgs) -> int:
    """Drafter parameters from the architecture alone (without the target's embedding and head)."""
    h, q, kv = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * a.intermediate_size + 2 * h + 2 * a.head_dim
    return a.num_layers * per_layer + a.num_target_layers * h * h + 2 * h  # fc, hidden_norm, norm


# experiment -> (target layer ids, mask token id, block size, drafter parameters in billions)
PRESETS = {
    "qwen3_4b": ([1, 9, 17, 25, 33], 151669, 16, 0.54),
    "qwen3_8b": ([1, 9, 17, 25, 33], 151669, 16, 1.05),
    "llama3_1_8b_instruct": ([1, 8, 15, 22, 29], 128002, 16, 1.17),
    "qwen3_5_27b": ([1, 16, 31, 46, 61], 248077, 16, 1.73),
    "llama3_3_70b": ([1, 20, 39, 58, 77], 128002, 16, 2.85),
    "qwen3_235b_a22b": ([1, 24, 46, 68, 91], 151669, 16, 1.20),
}
# Presets whose target is split over target.stages ranks per replica -> (stages, the whole target's
# parameters in billions, the public model cards' 70.6B and 235B).
STAGED = {"llama3_3_70b": (2, 70.55), "qwen3_235b_a22b": (4, 235.09)}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_composes_and_validates(name):
    ids, mask, block, billions = PRESETS[name]
    job = compose([f"experiment={name}"])
    assert job.name == name and job.data.seq_len == 3072
    tcfg = known_target_config(job.target.path)
    assert tcfg is not None, f"add {job.target.path} to dflash_mp.archs.TARGET_ARCHS"
    tok = FakeTokenizer(TARGET_ARCHS[job.target.path]["tokenizer_len"])
    layer_ids, mask_id = validate(job, tcfg, tok)
    assert (layer_ids, mask_id) == (ids, mask)
    args = build_drafter_args(job.drafter, tcfg, layer_ids, mask_id)
    assert isinstance(args, DrafterArgs) and args.block_size == block
    with torch.device("meta"):
        drafter = DFlashDrafter(args)
    n = sum(p.numel() for p in drafter.parameters())
    assert n == analytic_params(args)
    assert abs(n / 1e9 - billions) < 0.01, n
    t, d = job_workload(job, tcfg, TargetSpec.from_config(tcfg), layer_ids, mask_id).rates(790.0, 0.6, 0.5)
    assert t > 0 and d > 0


def test_27b_drafter_mixes_sliding_and_full_attention():
    job = compose(["experiment=qwen3_5_27b"])
    assert job.topology.num_target_ranks == "auto"
    tcfg = known_target_config(job.target.path)
    args = build_drafter_args(job.drafter, tcfg, [1, 16, 31, 46, 61], 248077)
    assert args.has_sliding and args.sliding_window == 2048
    assert set(args.layer_types) == {"sliding_attention", "full_attention"}


def test_llama_without_mask_token_names_the_fix():
    job = compose(["experiment=llama3_1_8b_instruct", "drafter.mask_token_id=null"])
    tcfg = known_target_config(job.target.path)
    with pytest.raises(ValueError, match="drafter.mask_token_id"):
        validate(job, tcfg, FakeTokenizer(128256))


@pytest.mark.parametrize("name,kwargs", [("qwen3_4b", {"enable_thinking": False}),
                                         ("qwen3_8b", {"enable_thinking": False}),
                                         ("qwen3_235b_a22b", {"enable_thinking": False}),
                                         ("llama3_1_8b_instruct", {}),
                                         ("llama3_3_70b", {})])
def test_presets_set_the_template_options_their_drafters_serve_with(name, kwargs):
    assert compose([f"experiment={name}"]).data.chat_template_kwargs == kwargs
    # `++` adds the key or overrides the preset's (the README's spelling).
    for value in (True, False):
        job = compose([f"experiment={name}", f"++data.chat_template_kwargs.enable_thinking={str(value).lower()}"])
        assert job.data.chat_template_kwargs == {"enable_thinking": value}


@pytest.mark.parametrize("name", sorted(STAGED))
def test_staged_preset_plans_balanced_stages_and_builds_its_last_stage_alone(name):
    from dflash_mp.archs import hf_config
    from dflash_mp.split import resolve_num_target_ranks
    from dflash_mp.stages import plan_stages
    from dflash_mp.target import strip_to_stage, truncate
    from transformers import AutoModelForCausalLM

    stages, billions = STAGED[name]
    job = compose([f"experiment={name}"])
    assert job.target.stages == stages and job.topology.num_target_ranks == "auto"
    tcfg = known_target_config(job.target.path)
    layer_ids, mask_id = validate(job, tcfg, FakeTokenizer(TARGET_ARCHS[job.target.path]["tokenizer_len"]))
    plan = plan_stages(tcfg, layer_ids, job.target.stages, job.data.seq_len)
    assert plan.stages == stages and plan.balance() > 0.9, plan.describe()
    assert plan.bounds[0][0] == 0 and plan.bounds[-1][1] == max(layer_ids) + 1
    n = resolve_num_target_ranks(job, 8, tcfg, TargetSpec.from_config(tcfg), layer_ids, mask_id)
    assert n % stages == 0 and 0 < n < 8

    # The whole model's skeleton, without weights, then what the last stage keeps (TargetWorker.load:
    # strip_to_stage, then truncate after the last captured layer).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config({"model_type": "llama", **tcfg}))
    layers = model.get_decoder().layers
    assert len(layers) == tcfg["num_hidden_layers"]
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    whole = sum(p.numel() for p in model.parameters())
    assert abs(whole / 1e9 - billions) < 0.01, whole  # the table's shapes (MoE experts included) are the model's
    first, end = plan.bounds[-1]
    last = max(layer_ids)
    strip_to_stage(model, first, end, keep_norm=end == last + 1)
    truncate(model, last)
    stage = sum(p.numel() for p in model.parameters())
    assert stage == sum(per_layer[first:end])  # no embedding, LM head, norm or other stage's layer
    assert stage < whole * (1 / stages + 0.05), (stage, whole)
    if stages == 4:
        assert stage < 0.45 * whole
