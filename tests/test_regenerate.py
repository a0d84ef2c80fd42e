"""Regeneration: output format, resumability (skip rows already written, cut a torn line), determinism."""

import json

import pytest
import torch

from dflash_mp.cli import compose_tool
from dflash_mp.regenerate import conversation_key, main

ROWS = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell cat."},
                  {"role": "assistant", "content": "c-a-t"}, {"role": "user", "content": "Backwards?"},
                  {"role": "assistant", "content": "t-a-c"}]},
    {"messages": []},  # bad: empty
    {"messages": [{"role": "user", "content": "Sort 3, 1, 2."}, {"role": "assistant", "content": "1, 2, 3"}]},
    {"messages": [{"role": "user", "content": "no reply"}]},  # bad: no assistant turn
    {"conversations": [{"from": "human", "value": "Hi!"}, {"from": "gpt", "value": "Hello."}]},
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "five"}]},
]
NUM_GOOD = 5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("regen")
    path = d / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return d, path


def run(data_path, out, cache, capsys, *extra):
    main([f"data.path={data_path}", f"out={out}", f"target.cache_dir={cache}", "max_new_tokens=6",
          "batch_size=2", *extra])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def read(path):
    return [json.loads(line) for line in open(path)]


def test_resume_format_and_determinism(data, capsys):
    d, path = data
    out, cache = d / "out.jsonl", d / "cache"
    first = run(path, out, cache, capsys, "data.max_rows=2")
    assert first["written"] == 2 and "skipped_done" not in first
    second = run(path, out, cache, capsys)
    assert second["skipped_done"] == 2 and second["written"] == NUM_GOOD - 2
    assert second["bad/empty"] == 1 and second["bad/no_assistant"] == 1
    rows = read(out)
    assert len(rows) == NUM_GOOD
    good = [r for r in ROWS if r.get("messages") and any(m["role"] == "assistant" for m in r["messages"])
            or "conversations" in r]
    for row, src in zip(rows, good):
        assert set(row) == {"messages"}
        msgs = row["messages"]
        src_msgs = src.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}[m["from"]],
                                            "content": m["value"]} for m in src["conversations"]]
        assert [m["role"] for m in msgs] == [m["role"] for m in src_msgs]
        # Only the assistant turns change; the rest is kept verbatim.
        assert conversation_key(msgs) == conversation_key(src_msgs)
        assert all(isinstance(m["content"], str) for m in msgs)
    # A torn last line (crash mid-write) is cut off and only its row is regenerated.
    text = out.read_text()
    lines = text.splitlines(keepends=True)
    out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    third = run(path, out, cache, capsys)
    assert third["written"] == 1 and third["skipped_done"] == NUM_GOOD - 1
    assert read(out) == rows

    # Greedy is deterministic and independent of batching: a fresh unbatched run (no padding)
    # writes what the resumed, left-padded batches of two wrote.
    fresh = d / "fresh.jsonl"
    run(path, fresh, cache, capsys, "batch_size=1")
    assert read(fresh) == rows


def test_overrides_split_between_tool_and_job():
    from dflash_mp.regenerate import RegenConfig

    argv = ["out=x.jsonl", "temperature=0.7", "data.path=y", "target.path=z"]
    job, mine = compose_tool("regen", RegenConfig, argv)
    assert (mine.out, mine.temperature) == ("x.jsonl", 0.7) and (job.data.path, job.target.path) == ("y", "z")
    with pytest.raises(ValueError, match="out="):
        main(["data.path=builtin:demo"])


@pytest.mark.parametrize("setting", ["target.reduction_configs", "target.cublas_workspace"])
def test_the_target_s_process_settings_are_applied_as_in_a_run(data, tmp_path, setting):
    """Regeneration's process takes the job's target settings before its first GEMM and compile, as a
    run's target does: a bad value is refused, named, before the model loads."""
    _, path = data
    with pytest.raises(ValueError, match=rf"{setting}='fastest': use "):
        main([f"data.path={path}", f"out={tmp_path / 'o.jsonl'}", f"target.cache_dir={tmp_path / 'c'}",
              f"{setting}=fastest"])
    assert not (tmp_path / "o.jsonl").exists()


def test_length_sorted_batches_write_what_one_by_one_greedy_writes(tmp_path, capsys, monkeypatch):
    from dflash_mp.regenerate import Regenerator

    words = "the cat sat on a mat and then it ran far away from home".split()
    rows = [{"messages": [{"role": "user", "content": " ".join(words[: 1 + (5 * i) % len(words)])},
                          {"role": "assistant", "content": "x"}]} for i in range(10)]
    rows[3]["messages"] += [{"role": "user", "content": "and again?"}, {"role": "assistant", "content": "y"}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache"
    widths = []
    generate = Regenerator.generate

    def spy(self, prompts, tools=None):
        if len(prompts[0]) == 1:  # first turns only (a later turn's prompt holds the earlier ones)
            widths.append([len(p[0]["content"]) for p in prompts])
        return generate(self, prompts, tools)

    monkeypatch.setattr(Regenerator, "generate", spy)
    run(src, tmp_path / "sorted.jsonl", cache, capsys, "batch_size=3", "sort_window=4")
    sorted_widths = widths[:]
    widths.clear()
    run(src, tmp_path / "single.jsonl", cache, capsys, "batch_size=1", "sort_window=1")
    # Same rows, in input order, whatever the batching.
    assert read(tmp_path / "sorted.jsonl") == read(tmp_path / "single.jsonl")
    assert [conversation_key(r["messages"]) for r in read(tmp_path / "sorted.jsonl")] == \
        [conversation_key(r["messages"]) for r in rows]
    # Batches went out longest first (the two-turn row leads), not in input order.
    two_turn = len(rows[3]["messages"][0]["content"])
    assert [len(b) for b in sorted_widths] == [3, 3, 3, 1] and sorted_widths[0][0] == two_turn
    lengths = [w for batch in sorted_widths for w in batch][1:]
    assert lengths == sorted(lengths, reverse=True) and len(set(lengths)) == 9
    assert [len(b) for b in widths] == [1] * 10


def test_a_random_builtin_target_regenerates(data, tmp_path, capsys):
    """The tools take every target.path the job takes: a random-weight builtin (no weight files)
    generates with the weights the job draws for it."""
    d, path = data
    stats = run(path, tmp_path / "out.jsonl", d / "cache", capsys, "target.path=builtin:random-tiny-qwen3")
    assert stats["written"] == NUM_GOOD
    assert all(m["content"] for row in read(tmp_path / "out.jsonl") for m in row["messages"])


@pytest.mark.slow
def test_two_processes_under_torchrun_write_what_one_process_writes(data, tmp_path, capsys):
    """`torchrun --nproc-per-node 2 -m dflash_mp.regenerate`: windows dealt out over 2 gloo ranks,
    merged in input order; sampled (temperature 0.8), so every batch's seed must match too."""
    import os
    import subprocess
    import sys

    d, path = data
    args = [f"data.path={path}", f"target.cache_dir={d / 'cache'}", "max_new_tokens=6", "batch_size=1",
            "sort_window=2", "temperature=0.8"]
    one = run(path, tmp_path / "one.jsonl", d / "cache", capsys, "batch_size=1", "sort_window=2", "temperature=0.8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                        "dflash_mp.regenerate", *args, f"out={tmp_path / 'two.jsonl'}"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    two = json.loads(p.stdout.strip().splitlines()[-1])
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert two["written"] == one["written"] == NUM_GOOD and two.get("bad/empty") == one.get("bad/empty")
    assert "rank 1: 2/2 rows" in p.stderr and not list(tmp_path.glob("two.jsonl.part*"))


def test_static_cache_writes_what_the_dynamic_cache_writes_whatever_the_batch_size(data, tmp_path, capsys,
                                                                                  monkeypatch):
    """The serving-speed path (`cache=static`: every batch padded to `batch_size` rows with filler
    copies, prompts left-padded to a bucket) writes the dynamic cache's greedy file byte for byte, at
    batch sizes 1 and 8; the fillers are neither written nor counted as generated tokens."""
    import transformers

    d, path = data
    calls = []
    generate = transformers.GenerationMixin.generate

    def spy(model, *args, **kwargs):
        ids = kwargs["input_ids"]
        calls.append((kwargs.get("cache_implementation"), *ids.shape))
        if kwargs.get("cache_implementation") == "static":  # no filler row left unmasked: each is a whole prompt
            assert bool((kwargs["attention_mask"].sum(1) > 0).all())
        return generate(model, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", spy)
    args = [f"data.path={path}", f"target.cache_dir={d / 'cache'}", "max_new_tokens=24", "sort_window=1"]

    def regen(name, *extra):
        calls.clear()
        main([*args, f"out={tmp_path / name}", *extra])
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1]), list(calls)

    ref, ref_calls = regen("dynamic.jsonl", "cache=dynamic", "batch_size=1")
    assert {c[0] for c in ref_calls} == {None} and {c[1] for c in ref_calls} == {1}
    for batch, bucket in [(1, 256), (8, 16)]:
        stats, static_calls = regen(f"static{batch}.jsonl", "cache=static", f"batch_size={batch}",
                                    f"prompt_bucket={bucket}")
        # The fast path ran: fixed rows, bucketed widths (batch 8: 5 rows and a second turn, so fillers).
        assert {c[0] for c in static_calls} == {"static"} and {c[1] for c in static_calls} == {batch}
        assert all(c[2] % bucket == 0 for c in static_calls)
        assert (tmp_path / f"static{batch}.jsonl").read_bytes() == (tmp_path / "dynamic.jsonl").read_bytes()
        assert stats == ref  # same rows written, same tokens counted: the fillers' are not
    assert len({c[2] for c in static_calls}) > 1  # several buckets (a cache sized per call)


def test_static_cache_is_sized_per_call_and_the_recompile_limit_covers_every_shape(tmp_path, monkeypatch, caplog):
    """A static cache gets its own call's length, not the longest call's so far, and each new
    (rows, cache length) shape past Dynamo's recompile limit raises the limit (logged)."""
    import logging

    import torch
    from transformers import AutoTokenizer

    from dflash_mp.builtin import resolve_target_path
    from dflash_mp.regenerate import GQA_DECODE, RegenConfig, Regenerator
    from dflash_mp.target import load_causal_lm

    path = resolve_target_path("builtin:tiny-qwen3", str(tmp_path))
    model = load_causal_lm(path, torch.device("cpu"), torch.float32)
    cfg = RegenConfig(max_new_tokens=3, batch_size=4, prompt_bucket=8)
    static = Regenerator(model, AutoTokenizer.from_pretrained(path), cfg, cache="static")
    dynamic = Regenerator(model, static.tok, cfg, cache="dynamic")
    assert (static.attention, dynamic.attention) == (GQA_DECODE, "sdpa")
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    monkeypatch.setattr(torch._dynamo.config, "accumulated_recompile_limit", 8)
    lengths = []
    with caplog.at_level(logging.INFO, logger="dflash_mp.regenerate"):
        for words in (40, 2, 20, 2):
            prompts = [[{"role": "user", "content": " ".join(["seven apples"] * words)}],
                       [{"role": "user", "content": "Hi!"}]]
            assert static.generate(prompts) == dynamic.generate(prompts)
            lengths.append(model._previous_max_cache_length)
    assert lengths[1] == lengths[3] < lengths[2] < lengths[0]  # the short calls' caches are short
    assert static.new_tokens == dynamic.new_tokens  # the two filler rows of every call are not counted
    assert len(static.shapes) == 3 and torch._dynamo.config.recompile_limit == 6
    assert "recompile_limit raised from 2 to 6" in caplog.text


def test_auto_cache_is_static_only_where_it_pays_and_the_model_allows_it(tmp_path, caplog):
    """`cache=auto`: dynamic on CPU (transformers compiles the static decode on CUDA only); static on
    CUDA for a Qwen3; a hybrid linear-attention model stays dynamic even when static is asked for."""
    import logging

    import torch

    from dflash_mp.builtin import resolve_target_path
    from dflash_mp.regenerate import resolve_cache
    from dflash_mp.target import load_causal_lm

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    dense = load_causal_lm(resolve_target_path("builtin:tiny-qwen3", str(tmp_path)), cpu, torch.float32)
    hybrid = load_causal_lm(resolve_target_path("builtin:random-tiny-qwen3.5", str(tmp_path)), cpu, torch.float32)
    with caplog.at_level(logging.INFO, logger="dflash_mp.regenerate"):
        assert resolve_cache("auto", dense, cpu) == "dynamic"
        assert resolve_cache("auto", dense, cuda) == "static"  # the choice only: nothing runs on the device
        assert resolve_cache("static", dense, cpu) == "static"
        assert resolve_cache("dynamic", dense, cuda) == "dynamic"
        assert resolve_cache("static", hybrid, cuda) == "dynamic"
        assert resolve_cache("auto", hybrid, cuda) == "dynamic"
    assert "linear_attention layers" in caplog.text and "CUDA only" in caplog.text
    with pytest.raises(ValueError, match="cache='fast' is not a cache; use one of auto, dynamic, static"):
        resolve_cache("fast", dense, cpu)


def test_gqa_decode_attends_on_the_key_value_heads_without_repeating_them(monkeypatch):
    """The static path's decode attention: each query head against its key/value head (as sdpa after
    repeating every key/value head per query head), under a padding mask or none, never through
    transformers' sdpa (which repeats them when a mask is given: compiled, and always in 5.17)."""
    import types

    import torch
    from transformers import AttentionInterface

    from dflash_mp.regenerate import sdpa_gqa_decode

    def repeating_sdpa(*args, **kwargs):
        raise AssertionError("a decode step went through transformers' sdpa")

    g = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, length, dim = 3, 2, 4, 37, 16
    q = torch.randn(batch, kv_heads * groups, 1, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=g) for _ in range(2))
    mask = torch.rand(batch, 1, 1, length, generator=g) > 0.3
    mask[..., -1] = True
    module = types.SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", repeating_sdpa)
    for m in (mask, None):
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=m, scale=0.3).transpose(1, 2)
        got, _ = sdpa_gqa_decode(module, q, k, v, m, dropout=0.0, scaling=0.3)
        assert got.shape == want.shape == (batch, 1, kv_heads * groups, dim)
        torch.testing.assert_close(got, want)


def test_the_static_paths_attention_is_not_taken_for_flash_attention():
    """transformers treats any attention whose name holds "flash" as flash attention (padding-free
    inputs, no fullgraph compile): the GQA decode attention must not read as one."""
    from transformers.utils.generic import is_flash_attention_requested

    from dflash_mp.regenerate import register_gqa_decode

    assert not is_flash_attention_requested(requested_attention_implementation=register_gqa_decode())


def test_static_decode_compiles_at_most_twice_over_batches_and_buckets(tmp_path, monkeypatch):
    """transformers compiles the static-cache decode step (on CUDA; here forced on CPU with Dynamo's
    eager backend), GQA attention included, as one graph: fixed rows keep the batch dimension out of
    the guards, so short batches and several prompt buckets cost one compile plus one for the cache
    length going dynamic."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoTokenizer, CompileConfig

    from dflash_mp.builtin import resolve_target_path
    from dflash_mp.regenerate import RegenConfig, Regenerator
    from dflash_mp.target import load_causal_lm

    path = resolve_target_path("builtin:tiny-qwen3", str(tmp_path))
    model = load_causal_lm(path, torch.device("cpu"), torch.float32)
    compile_config = CompileConfig(backend="eager", mode=None, fullgraph=True)  # a graph break would raise
    compile_config._compile_all_devices = True  # what CUDA gets by default
    cfg = RegenConfig(max_new_tokens=4, batch_size=4, prompt_bucket=8)
    dynamic = Regenerator(model, AutoTokenizer.from_pretrained(path), cfg, cache="dynamic")
    static = Regenerator(model, dynamic.tok, cfg, cache="static")
    batches = [[[{"role": "user", "content": " ".join(["seven apples"] * n)}] for n in ns]
               for ns in ([9, 3, 1, 2], [1], [30, 2], [4, 4, 4], [60])]
    want = [dynamic.generate(b) for b in batches]
    monkeypatch.setattr(model.generation_config, "compile_config", compile_config, raising=False)
    before = counters["stats"]["unique_graphs"]
    try:
        assert [static.generate(b) for b in batches] == want
        assert 1 <= counters["stats"]["unique_graphs"] - before <= 2
    finally:
        torch._dynamo.reset()


def test_progress_is_logged_after_every_batch(data, tmp_path, capsys, caplog):
    """Each batch logs the rows generated so far, those written, generated tokens/s and the ETA; the
    last line counts every row."""
    import logging
    import re

    d, path = data
    with caplog.at_level(logging.INFO, logger="dflash_mp.regenerate"):
        run(path, tmp_path / "out.jsonl", d / "cache", capsys, "sort_window=2")
    lines = [r.getMessage() for r in caplog.records if "rows generated" in r.getMessage()]
    counts = [tuple(map(int, re.search(r"(\d+)/(\d+) rows generated \((\d+) written\)", m).groups())) for m in lines]
    # 5 rows in batches of 2, windows of 4 rows: batches of 2, 2 (window written), then 1.
    assert counts == [(2, NUM_GOOD, 0), (4, NUM_GOOD, 0), (5, NUM_GOOD, 4)], lines
    assert all(re.search(r"\d+ tokens/s, [\d.]+ s, ETA \d+ s$", m) for m in lines)
    assert lines[-1].endswith("ETA 0 s")


def test_running_out_of_memory_names_the_batch_size_and_keeps_the_rows(data, tmp_path, capsys, monkeypatch):
    """An out-of-memory error in generation says which setting to lower, and what was written stays."""
    d, path = data
    out = tmp_path / "out.jsonl"
    run(path, out, d / "cache", capsys, "data.max_rows=2")
    written = out.read_text()

    def oom(self, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 GiB")

    from transformers import GenerationMixin
    monkeypatch.setattr(GenerationMixin, "generate", oom)
    with pytest.raises(RuntimeError, match=r"out of memory generating 2 rows .*lower regen\.batch_size \(now 2\)"):
        run(path, out, d / "cache", capsys)
    assert out.read_text() == written
