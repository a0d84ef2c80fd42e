"""ShardStream: disjoint covering shards, exact epochs, and a cursor that resumes identically."""

import multiprocessing as mp
import os
import random

import datasets
import pytest

from dflash_mp.data import DataConfig, ShardStream, build_stream, check_batch, split_eval
from dflash_mp.builtin import build_demo_tokenizer, demo_data_path, demo_texts

T, PAD, NUM_ROWS = 64, 0, 101


def make_rows(n: int = NUM_ROWS, seed: int = 0) -> datasets.Dataset:
    """Row r is `len_r` copies of token r + 1 (so every packed document names its row)."""
    rng = random.Random(seed)
    lengths = [rng.choice([3, 8, 13, 21, 30, 47, 64]) for _ in range(n)]
    lengths[5] = 150  # one conversation longer than T
    return datasets.Dataset.from_dict({
        "input_ids": [[r + 1] * n_r for r, n_r in enumerate(lengths)],
        "loss_mask": [[0] + [1] * (n_r - 1) for n_r in lengths],
    })


def rows_of(batch) -> list[int]:
    return [int(batch.input_ids[batch.doc_ids == d][0]) - 1 for d in range(batch.num_docs)]


def take(stream, n):
    return [next(stream) for _ in range(n)]


def same(a, b) -> bool:
    fields = ("input_ids", "position_ids", "doc_ids", "loss_mask")
    return all(getattr(x, f).equal(getattr(y, f)) for x, y in zip(a, b, strict=True) for f in fields)


@pytest.fixture(scope="module")
def rows():
    return make_rows()


@pytest.mark.parametrize("num_shards", [1, 3, 4])
def test_shards_are_disjoint_cover_and_each_epoch_reads_every_row_once(rows, num_shards):
    seen = []
    sizes = []
    for r in range(num_shards):
        s = ShardStream(rows, r, num_shards, T, PAD, seed=1)
        sizes.append(len(s))
        for epoch in range(2):
            got = [i for b in take(s, s.batches_per_epoch(epoch)) for i in rows_of(b)]
            assert sorted(got) == sorted(set(got)) and len(got) == len(s), "each row exactly once per epoch"
            if epoch == 0:
                seen += got
            assert s.state_dict() == {"epoch": epoch + 1, "batch": 0}
    assert sorted(seen) == list(range(NUM_ROWS))
    assert max(sizes) - min(sizes) <= 1


def test_batches_are_valid_and_counters_add_up(rows):
    s = ShardStream(rows, 0, 1, T, PAD, seed=0)
    n = s.batches_per_epoch()
    for b in take(s, n):
        check_batch(b, seq_len=T, pad_id=PAD)
    lengths = [len(x) for x in rows["input_ids"]]
    stats = s.stats()
    assert stats["batches"] == n and stats["docs"] == NUM_ROWS and stats["truncated"] == 1
    assert stats["tokens"] == sum(min(x, T) for x in lengths)


def test_shuffle_changes_per_epoch_and_is_seeded(rows):
    a, b = ShardStream(rows, 0, 1, T, PAD, seed=0), ShardStream(rows, 0, 1, T, PAD, seed=0)
    assert a.plan(0) == b.plan(0) and a.plan(0) != a.plan(1)
    assert ShardStream(rows, 0, 1, T, PAD, seed=1).plan(0) != a.plan(0)
    fixed = ShardStream(rows, 0, 1, T, PAD, shuffle=False)
    assert fixed.plan(0) == fixed.plan(3)
    assert [i for row in ShardStream(rows, 0, 1, T, PAD, shuffle=False, num_open=1).plan(0) for i in row] \
        == list(range(NUM_ROWS))


@pytest.mark.parametrize("where", ["start", "mid", "last_of_epoch", "boundary", "next_epoch"])
def test_resume_continues_identically(rows, where):
    ref_stream = ShardStream(rows, 1, 2, T, PAD, seed=3, num_open=4)
    e0, e1 = ref_stream.batches_per_epoch(0), ref_stream.batches_per_epoch(1)
    ref = take(ref_stream, e0 + e1 + 4)
    k = {"start": 0, "mid": e0 // 2, "last_of_epoch": e0 - 1, "boundary": e0, "next_epoch": e0 + 3}[where]
    first = ShardStream(rows, 1, 2, T, PAD, seed=3, num_open=4)
    take(first, k)
    state = first.state_dict()
    resumed = ShardStream(rows, 1, 2, T, PAD, seed=3, num_open=4)
    resumed.load_state_dict(dict(state))
    assert resumed.state_dict() == state
    assert same(take(resumed, len(ref) - k), ref[k:])


def test_bad_cursor_and_shards_raise(rows):
    s = ShardStream(rows, 0, 1, T, PAD)
    with pytest.raises(ValueError, match="cursor"):
        s.load_state_dict({"epoch": 0, "batch": s.batches_per_epoch(0)})
    with pytest.raises(ValueError, match="shard_index"):
        ShardStream(rows, 4, 4, T, PAD)
    with pytest.raises(ValueError, match="empty"):
        ShardStream(rows.select(range(2)), 2, 3, T, PAD)


def test_split_eval_is_deterministic_and_disjoint(rows):
    train, held = split_eval(rows, 0.1, seed=0)
    train2, held2 = split_eval(rows, 0.1, seed=0)
    assert held["input_ids"] == held2["input_ids"] and len(held) == 10 and len(train) == NUM_ROWS - 10
    tags = lambda ds: {x[0] for x in ds["input_ids"]}  # noqa: E731
    assert not tags(train) & tags(held) and len(tags(train) | tags(held)) == NUM_ROWS
    assert split_eval(rows, 0.1, seed=1)[1]["input_ids"] != held["input_ids"]


def test_build_stream_on_the_demo_data():
    tok = build_demo_tokenizer(demo_texts())
    cfg = DataConfig(path=demo_data_path(), seq_len=128, eval_fraction=0.05)
    streams = [build_stream(cfg, tok, r, 2) for r in range(2)]
    held = build_stream(cfg, tok, 0, 1, part="eval")
    assert sum(len(s) for s in streams) + len(held) == 800
    assert held.plan(0) == held.plan(1)  # evaluation order is fixed
    for s in streams + [held]:
        assert not any(k.startswith("skipped/") for k in s.stats())
        for b in take(s, 5):
            check_batch(b, seq_len=128, pad_id=tok.pad_token_id)
            assert b.num_valid_tokens > 64 and int(b.loss_mask.sum()) > 0
    with pytest.raises(ValueError, match="eval_fraction"):
        build_stream(DataConfig(path=demo_data_path()), tok, 0, 1, part="eval")


def _tokenize_concurrently(barrier, calls_dir: str, rank: int, queue) -> None:
    """Child process: count this process's tokenizer calls, then build the stream with the others."""
    from dflash_mp.data import chat

    encode = chat.ChatEncoder.__call__

    def counting(self, batch):
        with open(os.path.join(calls_dir, f"rank{rank}"), "a") as f:
            f.write(f"{len(next(iter(batch.values())))}\n")
        return encode(self, batch)

    chat.ChatEncoder.__call__ = counting
    tok = build_demo_tokenizer(demo_texts())
    barrier.wait()  # start together, as the target ranks of one node do
    stream = build_stream(DataConfig(path=demo_data_path(), seq_len=128), tok, 0, 1)
    queue.put((rank, next(stream).input_ids.tolist()))


def test_ranks_on_a_node_tokenize_once_and_share_the_cache(tmp_path, monkeypatch):
    """Three processes build the same stream at once: one tokenizes, the others load its cached rows."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    calls = tmp_path / "calls"
    calls.mkdir()
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_tokenize_concurrently, args=(barrier, str(calls), r, queue)) for r in range(3)]
    for p in procs:
        p.start()
    first = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert first[0] == first[1] == first[2]  # same rows, same order
    tokenized = sorted(f.name for f in calls.iterdir())
    assert len(tokenized) == 1, f"tokenized by {tokenized}; one process should, the others load the cache"
    assert sum(int(n) for n in (calls / tokenized[0]).read_text().split()) == 800
