"""The per-target-rank stream of `PackedBatch`es: shard, shuffle per epoch, pack, forever.

The cursor is `(epoch, batch)`: the epoch's order is a pure function of (seed, epoch, shard) and the
plan a pure function of that order and the row lengths, so restoring the two ints resumes the exact
same sequence of batches without saving any data-dependent state.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict

import numpy as np
import pyarrow.compute as pc

from dflash_mp.batch import PackedBatch
from dflash_mp.data.chat import check_split, explain_skips, load_conversations, tokenize_dataset
from dflash_mp.data.packing import pack_rows, plan_batches
from dflash_mp.fsutil import file_lock

if TYPE_CHECKING:
    import datasets


@dataclass
class DataConfig:
    path: str = "builtin:demo"  # hub dataset id, local .json/.jsonl/.parquet file or dir, or builtin:demo
    split: str = "train"  # split to read; local files are one "train" split (slices like "train[:90%]" work)
    seq_len: int = 512  # packing budget T: tokens per PackedBatch
    shuffle: bool = True  # reshuffle each shard every epoch
    seed: int = 0  # seeds the per-epoch shuffles and the held-out split
    num_proc: int = 1  # tokenisation worker processes (Dataset.map)
    messages_field: str = "messages"  # column holding the conversation; ShareGPT "conversations" also read
    max_rows: int = 0  # use only the first N rows (0 = all)
    eval_fraction: float = 0.0  # fraction of tokenized rows held out for evaluation (0 = none)
    pack_window: int = 8  # rows kept open while packing; 1 = next-fit, more = less padding
    # Options of the chat template, passed to every render (training, regenerate, evaluate) and
    # recorded in the export: e.g. {enable_thinking: false} for Qwen3 served without thinking.
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    unfinished: str = "drop"  # replies the model never ended (cut by max_new_tokens, open <think>):
    #   drop (skip the row) | keep_open (supervise the reply, not an end-of-turn token it never wrote)
    # Rows whose messages hold more characters are skipped (row_too_long) before they are rendered or
    # tokenized: a multi-MB row would cost GBs of tokenizer memory to train on its first seq_len tokens.
    max_row_chars: int = 1_000_000  # 0 = no limit

    def __post_init__(self):
        if self.seq_len < 16:
            raise ValueError(f"data.seq_len={self.seq_len} is too small; use at least 16 (e.g. 512 or 3072)")
        if self.num_proc < 1:
            raise ValueError(f"data.num_proc={self.num_proc}; use 1 (in-process) or more worker processes")
        if self.max_rows < 0:
            raise ValueError(f"data.max_rows={self.max_rows}; use 0 for all rows or a positive count")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction={self.eval_fraction}; use a value in [0, 1), e.g. 0.02")
        if self.pack_window < 1:
            raise ValueError(f"data.pack_window={self.pack_window}; use 1 (next-fit) or more")
        if self.unfinished not in ("drop", "keep_open"):
            raise ValueError(f"data.unfinished={self.unfinished!r}: use drop or keep_open")
        if not self.path:
            raise ValueError("data.path is empty; use a hub id, a local file/directory, or 'builtin:demo'")
        if self.max_row_chars < 0:
            raise ValueError(f"data.max_row_chars={self.max_row_chars}; use 0 (no limit) or a positive count")
        check_split(self)


def split_eval(ds: datasets.Dataset, fraction: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, held-out) rows: a seeded random `fraction` (at least one row) is held out.

    Depends only on (len(ds), fraction, seed), so every rank holds out the same rows.
    """
    n = len(ds)
    num_eval = max(1, round(n * fraction))
    if num_eval >= n:
        raise ValueError(f"data.eval_fraction={fraction} leaves no training rows out of {n}; lower it")
    perm = np.random.default_rng([seed, n]).permutation(n)
    return ds.select(np.sort(perm[num_eval:])), ds.select(np.sort(perm[:num_eval]))


class ShardStream:
    """Endless iterator of `PackedBatch` over shard `shard_index` of `num_shards` of `tokenized_ds`.

    Shards are contiguous and equal in size to within one row. Each epoch visits every row of the
    shard exactly once (an over-long row truncated to `seq_len`).
    """

    def __init__(self, tokenized_ds: datasets.Dataset, shard_index: int, num_shards: int, seq_len: int,
                 pad_id: int, seed: int = 0, shuffle: bool = True, num_open: int = 1,
                 skipped: Counter | None = None):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index={shard_index} is outside 0..{num_shards - 1}")
        if len(tokenized_ds) < num_shards:
            raise ValueError(f"{len(tokenized_ds)} rows cannot fill {num_shards} shards: some would be "
                             "empty; use more data or fewer target ranks")
        self.ds = tokenized_ds.shard(num_shards, shard_index, contiguous=True)
        self.shard_index, self.seq_len, self.pad_id = shard_index, seq_len, pad_id
        self.seed, self.shuffle, self.num_open = seed, shuffle, num_open
        # Arrow list lengths: no token data is read to plan.
        self.lengths = pc.list_value_length(self.ds.with_format("arrow")[:]["input_ids"]).to_pylist()
        self.epoch, self.batch = 0, 0
        self._plans: dict[int, list[list[int]]] = {}
        self.counters: Counter = Counter({f"skipped/{k}": v for k, v in (skipped or {}).items()})

    def __len__(self) -> int:
        return len(self.ds)

    def plan(self, epoch: int) -> list[list[int]]:
        """Row indices of every batch of `epoch`, in emission order."""
        if epoch not in self._plans:
            n = len(self.lengths)
            order = np.random.default_rng([self.seed, epoch, self.shard_index]).permutation(n).tolist() \
                if self.shuffle else range(n)
            if len(self._plans) >= 2:  # current and next epoch are all an iterator needs
                self._plans.pop(min(self._plans))
            self._plans[epoch] = plan_batches(self.lengths, self.seq_len, order, self.num_open)
        return self._plans[epoch]

    def batches_per_epoch(self, epoch: int = 0) -> int:
        return len(self.plan(epoch))

    def __iter__(self) -> "ShardStream":
        return self

    def __next__(self) -> PackedBatch:
        plan = self.plan(self.epoch)
        rows = plan[self.batch]
        cols = self.ds[rows]
        batch = pack_rows(list(zip(cols["input_ids"], cols["loss_mask"])), self.seq_len, self.pad_id)
        self.counters["batches"] += 1
        self.counters["docs"] += batch.num_docs
        self.counters["tokens"] += batch.num_valid_tokens
        self.counters["truncated"] += sum(self.lengths[i] > self.seq_len for i in rows)
        self.batch += 1
        if self.batch == len(plan):
            self.epoch, self.batch = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        """The next batch to emit."""
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if not 0 <= batch < self.batches_per_epoch(epoch):
            raise ValueError(f"data cursor {state} is past the {self.batches_per_epoch(epoch)} batches of "
                             f"epoch {epoch}; was the checkpoint written with other data or data settings?")
        self.epoch, self.batch = epoch, batch

    def stats(self) -> dict[str, int]:
        """Counters: skipped/<reason> (whole data set), truncated, batches, docs, tokens (this stream)."""
        return dict(self.counters)


def _tokenize_in_turn(raw: datasets.Dataset):
    """Processes on one node tokenizing the same file-backed data set take turns.

    Every target rank tokenizes the whole data set (so shards and skip counts agree). Run at once,
    8 ranks of a node would each tokenize it from scratch; in turn, the first one writes the
    tokenized rows to the `datasets` cache and the others load them from there.
    In-memory data sets have no cache to share, so they do not wait. The lock file is node-local
    and keyed by the data set's fingerprint, so unrelated jobs never wait on each other.
    """
    if not raw.cache_files:
        return contextlib.nullcontext()
    return file_lock(os.path.join(tempfile.gettempdir(), f"dflash_mp-tokenize-{raw._fingerprint}.lock"))


def build_stream(cfg: DataConfig, tokenizer, shard_index: int, num_shards: int,
                 vocab_limit: int | None = None, part: str = "train") -> ShardStream:
    """Load, tokenize (the whole data set, so shards and skip counts agree on every rank) and shard.

    `part="eval"` streams the held-out rows (needs `cfg.eval_fraction > 0`) in a fixed order.
    """
    if part not in ("train", "eval"):
        raise ValueError(f"part={part!r}; use 'train' or 'eval'")
    if part == "eval" and cfg.eval_fraction <= 0:
        raise ValueError("an eval stream needs data.eval_fraction > 0 (e.g. 0.02)")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
    raw = load_conversations(cfg)
    with _tokenize_in_turn(raw):
        tokenized, skipped = tokenize_dataset(raw, tokenizer, cfg, vocab_limit)
    if len(tokenized) < max(num_shards, 1):
        skips = f"; rows skipped: {explain_skips(skipped)}" if skipped else ""
        fix = "fix the data" if not len(tokenized) else \
            "use more data or fewer target ranks (topology.num_target_ranks)"
        raise ValueError(f"data.path={cfg.path!r}: {len(tokenized)} usable rows of {len(raw)} cannot fill "
                         f"{num_shards} target shard(s){skips}; {fix}")
    if cfg.eval_fraction > 0:
        train, held_out = split_eval(tokenized, cfg.eval_fraction, cfg.seed)
        tokenized = train if part == "train" else held_out
    return ShardStream(tokenized, shard_index, num_shards, cfg.seq_len, pad_id, seed=cfg.seed,
                       shuffle=cfg.shuffle and part == "train", num_open=cfg.pack_window, skipped=skipped)
