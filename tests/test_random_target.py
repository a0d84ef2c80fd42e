"""Random-weight builtin targets (config + tokenizer + seed, no weight files) and long demo chats."""

import json
import math
import os

import pytest
import torch
from transformers import AutoTokenizer

from dflash_mp.archs import known_target_config
from dflash_mp.builtin import resolve_target_path
from dflash_mp.builtin.__main__ import main
from dflash_mp.target import RANDOM_INIT, TargetWorker, load_target_config, load_target_head

from e2e_utils import SMALL, losses, torchrun
from test_target import packed

TINY = "builtin:random-tiny-qwen3"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def test_builtins_resolve_to_config_tokenizer_and_marker_only(cache):
    for name in (TINY, "builtin:random-qwen3-8b"):
        path = resolve_target_path(name, cache)
        files = os.listdir(path)
        assert {"config.json", "tokenizer.json", RANDOM_INIT} <= set(files), files
        assert not [f for f in files if f.endswith((".safetensors", ".bin"))], files
        assert json.load(open(os.path.join(path, RANDOM_INIT))) == {"seed": 0}
        tokenizer = AutoTokenizer.from_pretrained(path)
        cfg = load_target_config(path)
        assert cfg["model_type"] == "qwen3" and not cfg["tie_word_embeddings"]
        assert len(tokenizer) < cfg["vocab_size"]  # a spare row for the mask token
        assert cfg["eos_token_id"] == tokenizer.eos_token_id and cfg["pad_token_id"] == tokenizer.pad_token_id
    want = known_target_config("Qwen/Qwen3-8B")
    assert cfg["rope_parameters"]["rope_theta"] == want.pop("rope_theta")
    assert {k: cfg[k] for k in want} == want
    with pytest.raises(ValueError, match="random-qwen3-8b"):  # the message lists every builtin
        resolve_target_path("builtin:random-qwen3-9b", cache)


def test_load_is_seeded_and_agrees_with_the_drafter_head(cache):
    path = resolve_target_path(TINY, cache)
    cpu = torch.device("cpu")
    rng = torch.get_rng_state()
    workers = [TargetWorker.load(path, [1, 3], cpu, torch.float32) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is untouched
    batch = packed([40, 25, 30], 128)
    a, b = (w.forward(batch).hidden for w in workers)
    assert a.shape == (128, 2 * 128) and torch.isfinite(a).all()
    assert torch.equal(a, b)
    embed, head = load_target_head(path, torch.float32, cpu)
    assert torch.equal(workers[0].model.get_input_embeddings().weight, embed)
    assert head.shape == embed.shape and not torch.equal(head, embed)


@pytest.mark.parametrize("tied", [True, False])
def test_a_random_target_ties_its_head_as_its_config_says(tmp_path, tied):
    """A random target of a config with tied embeddings (Qwen3-4B's) holds one tensor for both on
    drafter ranks, as a checkpoint's does (the planner counts one), and the whole model the tools load
    generates with that very head."""
    from dflash_mp.builtin.chats import demo_texts
    from dflash_mp.builtin.targets import build_demo_tokenizer, build_random_target
    from dflash_mp.target import load_causal_lm

    path = build_random_target(str(tmp_path / "target"), build_demo_tokenizer(demo_texts()),
                               num_hidden_layers=2, tie_word_embeddings=tied)
    cpu = torch.device("cpu")
    embed, head = load_target_head(path, torch.float32, cpu)
    assert (embed.data_ptr() == head.data_ptr()) == tied
    assert torch.equal(embed, head) == tied
    lm = load_causal_lm(path, cpu, torch.float32)
    assert torch.equal(lm.get_input_embeddings().weight, embed)
    assert torch.equal(lm.get_output_embeddings().weight, head)


@pytest.mark.slow
def test_trainer_runs_on_a_random_target(tmp_path, cache):
    run_dir = str(tmp_path / "run")
    torchrun(2, SMALL + [f"run_dir={run_dir}", f"target.path={TINY}", f"target.cache_dir={cache}",
                         "topology.num_target_ranks=1", "train.max_steps=8", "checkpoint.every=0"])
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 9))
    assert all(math.isfinite(v) for v in got.values())


def test_make_data_turns(tmp_path):
    out = tmp_path / "long.jsonl"
    main(["make-data", f"make_data.out={out}", "make_data.num=30", "make_data.turns=3"])
    rows = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert len(rows) == 30
    for messages in rows:
        roles = [m["role"] for m in messages if m["role"] != "system"]
        assert roles == ["user", "assistant"] * 3, roles


@pytest.mark.parametrize("name", [TINY, "builtin:random-tiny-qwen3.5"])
def test_the_tools_load_the_very_target_the_job_trains_against(cache, name):
    """regenerate and evaluate generate with the whole causal LM (`load_causal_lm`): for a random
    builtin it is drawn as the job draws it: the layers TargetWorker captures, the embedding and the
    LM head drafter ranks train against."""
    from dflash_mp.target import load_causal_lm

    path = resolve_target_path(name, cache)
    cpu = torch.device("cpu")
    n = load_target_config(path)["num_hidden_layers"]
    try:
        lm = load_causal_lm(path, cpu, torch.float32)
    except ValueError as err:  # a host with fla-core and transformers <= 5.24: no CPU forward of Qwen3.5 there
        if "fla-core" not in str(err):
            raise
        pytest.skip(str(err))
    embed, head = load_target_head(path, torch.float32, cpu)
    assert torch.equal(lm.get_input_embeddings().weight, embed)
    assert torch.equal(lm.get_output_embeddings().weight, head)
    layer_ids = [1, n - 1]
    pb = packed([40], 40)
    with torch.no_grad():
        states = lm(input_ids=pb.input_ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([states[i + 1][0] for i in layer_ids], dim=-1)
    got = TargetWorker.load(path, layer_ids, cpu, torch.float32).forward(pb).hidden
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_tools_refuse_a_cpu_forward_that_transformers_would_send_to_fla(cache, monkeypatch):
    """transformers <= 5.24 with fla-core installed runs Qwen3.5's linear attention through fla-core's GPU
    kernels even for CPU tensors: load_causal_lm on the CPU says so and names the fixes. A target without
    linear attention, a transformers that checks the device, or no fla-core load as before."""
    from transformers.integrations import hub_kernels

    from dflash_mp.target import linear_attn, load_causal_lm, weights

    monkeypatch.setattr(linear_attn, "fla_available", lambda: True)
    monkeypatch.delattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", raising=False)
    hybrid = resolve_target_path("builtin:random-tiny-qwen3.5", cache)
    with monkeypatch.context() as m:  # refused before any weight is drawn or loaded
        m.setattr(weights, "random_target", lambda *a, **k: pytest.fail("the weights loaded before the refusal"))
        with pytest.raises(ValueError, match=r"fla-core's GPU kernels even on cpu.*transformers>=5.25.*uninstall fla"):
            load_causal_lm(hybrid, torch.device("cpu"), torch.float32)
    load_causal_lm(resolve_target_path(TINY, cache), torch.device("cpu"), torch.float32)  # no linear attention
    monkeypatch.setattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {"fla": ("cuda",)}, raising=False)
    load_causal_lm(hybrid, torch.device("cpu"), torch.float32)  # this transformers checks the device
    monkeypatch.delattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES")
    monkeypatch.setattr(linear_attn, "fla_available", lambda: False)
    load_causal_lm(hybrid, torch.device("cpu"), torch.float32)  # no fla-core
