"""Regeneration: output format, resumability (skip rows already written, cut a torn line), determinism."""

import json

import pytest

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
