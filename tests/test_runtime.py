"""Start-up facts are derived once, at the edge: builtin names become real paths in one place, and
layer ids, mask id and the target's shape have one derivation that every command shares."""

import os

import pytest

from dflash_mp.builtin import cache_root, resolve, resolve_target_path
from dflash_mp.config import compose
from dflash_mp.plan import planned_ids, target_config_for
from dflash_mp.runtime import prepare
from dflash_mp.target import TargetSpec


def test_resolve_turns_every_builtin_name_into_a_real_path(tmp_path):
    job = compose([f"target.cache_dir={tmp_path}"])
    assert job.target.path.startswith("builtin:") and job.data.path.startswith("builtin:")
    real = resolve(job)
    assert os.path.isfile(os.path.join(real.target.path, "config.json"))
    assert os.path.dirname(real.target.path) == str(tmp_path)
    assert os.path.isfile(real.data.path) and real.data.path.endswith("demo_chat.jsonl")
    assert resolve(real) == real  # real paths pass through
    assert job.target.path.startswith("builtin:")  # the caller's job is left as it was


def test_one_cache_root_the_setting_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MP_CACHE", str(tmp_path / "env"))
    assert cache_root("") == str(tmp_path / "env")
    assert cache_root(str(tmp_path / "set")) == str(tmp_path / "set")
    monkeypatch.delenv("DFLASH_MP_CACHE")
    assert cache_root("") == os.path.expanduser(os.path.join("~", ".cache", "dflash_mp"))


def test_resolving_an_unbuilt_learned_target_refuses_instead_of_training(tmp_path):
    with pytest.raises(ValueError, match="build-learned build_learned.size=tiny"):
        resolve_target_path("builtin:learned-qwen3", str(tmp_path))
    with pytest.raises(ValueError, match="build-learned build_learned.size=medium"):
        prepare(compose(["target.path=builtin:learned-qwen3-medium", f"target.cache_dir={tmp_path}"]))
    assert os.listdir(tmp_path) == []  # nothing was trained or written


def test_planner_and_run_derive_the_same_layer_ids_and_mask(tmp_path):
    for extra in ([], ["target.num_capture=2"], ["drafter.mask_token_id=7", "target.layer_ids=[3,1]"]):
        res = prepare(compose([f"target.cache_dir={tmp_path}", *extra]))
        assert planned_ids(res.job, target_config_for(res.job)) == (res.layer_ids, res.mask_token_id)
    assert res.layer_ids == [1, 3] and res.mask_token_id == 7
    assert res.spec == TargetSpec.from_config(res.target_config)


def test_target_spec_reads_either_rope_layout_and_fills_implicit_heads():
    base = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, vocab_size=100, num_attention_heads=8)
    spec = TargetSpec.from_config(base)
    assert (spec.num_kv_heads, spec.head_dim, spec.rope_theta, spec.rope_scaling) == (8, 8, 1e6, None)
    assert spec.sliding_window is None
    v4 = TargetSpec.from_config({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    v5 = TargetSpec.from_config({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}})
    assert v4 == v5 and v4.rope_theta == 5e5 and v4.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    swa = TargetSpec.from_config({**base, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 32,
                                  "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert (swa.num_kv_heads, swa.head_dim, swa.sliding_window) == (2, 16, 32)


def test_the_target_spec_is_parsed_once_for_the_start_up_and_the_planner(tmp_path, monkeypatch):
    """`prepare` parses the target's config into `Resolved.spec`; the planner and the roles read it."""
    from dflash_mp import split

    calls = []
    parse = TargetSpec.from_config.__func__

    def counting(cls, config):
        calls.append(1)
        return parse(cls, config)

    monkeypatch.setattr(TargetSpec, "from_config", classmethod(counting))
    res = prepare(compose([f"target.cache_dir={tmp_path}", "topology.num_target_ranks=auto"]))
    n = split.resolve_num_target_ranks(res.job, 4, res.target_config, res.spec, res.layer_ids, res.mask_token_id)
    assert 1 <= n <= 3 and len(calls) == 1, len(calls)


@pytest.mark.parametrize("overrides", [["target.rows_per_forward=0"],
                                       ["target.rows_per_forward=2", "target.stages=2"]])
def test_rows_per_forward_is_refused_below_one_and_with_a_staged_target(tmp_path, overrides):
    with pytest.raises(ValueError, match=r"target.rows_per_forward=\d with target.stages=\d: use 1 or more"):
        prepare(compose([f"target.cache_dir={tmp_path}", *overrides]))
    prepare(compose([f"target.cache_dir={tmp_path}", "target.rows_per_forward=2"]))  # one stage: taken


def test_each_process_of_a_node_takes_the_gpu_its_local_rank_names(monkeypatch):
    """pick_device: GPU LOCAL_RANK mod the GPU count, made current (the tools pass nothing and get the
    same as a run's ranks); the CPU where CUDA is absent. The GPU count is stood in for on CPU."""
    import torch
    from dflash_mp.runtime import pick_device

    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert pick_device() == torch.device("cuda", 2) and made_current == [torch.device("cuda", 2)]
    assert pick_device(1) == torch.device("cuda", 1)  # an explicit local rank wins over the environment
    monkeypatch.delenv("LOCAL_RANK")
    assert pick_device() == torch.device("cuda", 0)  # outside torchrun
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device() == torch.device("cpu") and len(made_current) == 3
