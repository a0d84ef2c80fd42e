"""Demo assets: the local tokenizer, the tiny Qwen3 target (built once, race-safe) and the data file."""

import json
import multiprocessing as mp
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_mp.data import DataConfig, load_conversations, tokenize_dataset
from dflash_mp.builtin import (
    BUILTIN_TARGET,
    build_demo_target,
    build_demo_tokenizer,
    demo_data_path,
    demo_texts,
    resolve_target_path,
)
from dflash_mp.builtin.__main__ import main
from dflash_mp.builtin.chats import write_demo_data

CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."}]


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer(demo_texts())


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return resolve_target_path(BUILTIN_TARGET, str(tmp_path_factory.mktemp("cache")))


def test_tokenizer_round_trip_and_specials(tok):
    assert 1000 <= len(tok) <= 2000
    for text in ["Spell the word 'garden' backwards.", "ünïcödé 🎉 日本語\t\r\n  spaces", ""]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    assert build_demo_tokenizer(demo_texts()).get_vocab() == tok.get_vocab()  # deterministic


def test_chat_template_is_chatml(tok):
    assert tok.apply_chat_template(CHAT, tokenize=False) == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n2 + 3 = 5.<|im_end|>\n")
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_builtin_target_builds_and_loads(target_dir, tok, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    loaded = AutoTokenizer.from_pretrained(target_dir)
    cfg = model.config
    assert cfg.model_type == "qwen3" and not cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (128, 6, 4, 2, 32, 384, 4096)
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= len(loaded) + 8  # spare rows for a mask token
    assert model.get_input_embeddings().weight.shape[0] == cfg.vocab_size
    assert loaded.apply_chat_template(CHAT, tokenize=False) == tok.apply_chat_template(CHAT, tokenize=False)
    assert loaded("What is 2 + 3?")["input_ids"] == tok("What is 2 + 3?")["input_ids"]
    text = loaded.apply_chat_template(CHAT, tokenize=False)
    ids = torch.tensor([loaded(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (1, ids.shape[1], cfg.vocab_size) and len(out.hidden_states) == 7
    # Cached: a second call returns the same directory without rebuilding it.
    mtime = os.path.getmtime(os.path.join(target_dir, "config.json"))
    assert resolve_target_path(BUILTIN_TARGET, os.path.dirname(target_dir)) == target_dir
    assert os.path.getmtime(os.path.join(target_dir, "config.json")) == mtime
    assert resolve_target_path("Qwen/Qwen3-8B", str(tmp_path)) == "Qwen/Qwen3-8B"
    with pytest.raises(ValueError, match="builtin"):
        resolve_target_path("builtin:huge-model", str(tmp_path))


def test_target_init_is_seeded(tok, tmp_path):
    dirs = [build_demo_target(str(tmp_path / f"t{k}"), tok, seed=s, num_hidden_layers=2)
            for k, s in enumerate((0, 0, 1))]
    weights = [AutoModelForCausalLM.from_pretrained(d).state_dict() for d in dirs]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not torch.equal(weights[0]["model.embed_tokens.weight"], weights[2]["model.embed_tokens.weight"])
    # A second writer to an existing directory keeps the first copy (what a lost race does).
    mtime = os.path.getmtime(os.path.join(dirs[0], "model.safetensors"))
    assert build_demo_target(dirs[0], tok, seed=1, num_hidden_layers=2) == dirs[0]
    assert os.path.getmtime(os.path.join(dirs[0], "model.safetensors")) == mtime
    assert sorted(os.listdir(tmp_path)) == ["t0", "t1", "t2"]
    with pytest.raises(ValueError, match="unknown Qwen3Config"):
        build_demo_target(str(tmp_path / "bad"), tok, hiden_size=64)


def _race(cache_dir, barrier, out):
    barrier.wait()
    with open(out, "w") as f:
        f.write(resolve_target_path(BUILTIN_TARGET, cache_dir))


def test_concurrent_builds_do_not_corrupt(tmp_path):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    outs = [str(tmp_path / f"out{k}") for k in range(2)]
    procs = [ctx.Process(target=_race, args=(str(tmp_path / "cache"), barrier, o)) for o in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    paths = {open(o).read() for o in outs}
    assert len(paths) == 1
    path = paths.pop()
    assert os.listdir(tmp_path / "cache") == [os.path.basename(path)]  # no temp dirs left behind
    AutoModelForCausalLM.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)


def test_shipped_asset_is_clean_and_reproducible(tok, tmp_path):
    path = demo_data_path()
    assert os.path.getsize(path) < 400_000
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 800 and all(set(r) == {"messages"} for r in rows)
    assert all(any(m["role"] == "assistant" for m in r["messages"]) for r in rows)
    cfg = DataConfig(path=demo_data_path())  # builtin:demo, resolved
    ds, skipped = tokenize_dataset(load_conversations(cfg), tok, cfg)
    assert not skipped and len(ds) == 800
    regenerated = tmp_path / "demo.jsonl"
    main(["make-data", f"make_data.out={regenerated}", "make_data.num=800", "make_data.seed=0"])
    assert regenerated.read_bytes() == open(path, "rb").read()
    write_demo_data(str(tmp_path / "other.jsonl"), 20, seed=1)
    assert (tmp_path / "other.jsonl").read_text().splitlines()[0] != regenerated.read_text().splitlines()[0]
