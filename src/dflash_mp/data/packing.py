"""Pack whole conversations into fixed-size rows of `seq_len` tokens.

Planning works on lengths only, so a whole epoch's plan is cheap to (re)compute: that is what makes
the stream's cursor resumable and `batches_per_epoch` exact without touching token data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_mp.batch import PackedBatch


def plan_batches(
    lengths: Sequence[int], seq_len: int, order: Sequence[int], num_open: int = 1
) -> list[list[int]]:
    """Group row indices (visited in `order`) into rows of at most `seq_len` tokens.

    Greedy and deterministic. A conversation longer than `seq_len` counts as `seq_len` tokens (it is
    truncated when packed), so it fills a row alone; a conversation is never split across rows.
    `num_open` rows stay open at once and each conversation goes into the first open row it fits;
    1 is plain next-fit, a few more cut the padding when lengths vary. When a new row is needed and
    `num_open` rows are open, the oldest is emitted.
    """
    plan: list[list[int]] = []
    open_rows: list[tuple[list[int], int]] = []  # (row indices, tokens used)
    for i in order:
        n = min(lengths[i], seq_len)
        for k, (docs, used) in enumerate(open_rows):
            if used + n <= seq_len:
                docs.append(i)
                open_rows[k] = (docs, used + n)
                break
        else:
            if len(open_rows) == num_open:
                plan.append(open_rows.pop(0)[0])
            open_rows.append(([i], n))
            k = len(open_rows) - 1
        if open_rows[k][1] == seq_len:  # full: nothing else can join it
            plan.append(open_rows.pop(k)[0])
    plan += [docs for docs, _ in open_rows]
    return plan


def pack_rows(rows: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, pad_id: int) -> PackedBatch:
    """Concatenate `(input_ids, loss_mask)` documents into one `PackedBatch` of `seq_len` tokens.

    Each document is cut to `seq_len` tokens; together they must fit (the plan guarantees it).
    """
    ids, pos, docs, mask = [], [], [], []
    for d, (doc_ids, doc_mask) in enumerate(rows):
        assert len(doc_ids) == len(doc_mask), "input_ids and loss_mask lengths differ"
        n = min(len(doc_ids), seq_len)
        ids += doc_ids[:n]
        mask += doc_mask[:n]
        pos += range(n)
        docs += [d] * n
    valid = len(ids)
    assert valid <= seq_len, f"{valid} tokens do not fit in seq_len={seq_len}"
    pad = seq_len - valid
    return PackedBatch(
        input_ids=torch.tensor(ids + [pad_id] * pad, dtype=torch.long),
        position_ids=torch.tensor(pos + [0] * pad, dtype=torch.long),
        doc_ids=torch.tensor(docs + [-1] * pad, dtype=torch.long),
        loss_mask=torch.tensor(mask + [0] * pad, dtype=torch.long),
        num_docs=len(rows),
        num_valid_tokens=valid,
    )


def check_batch(batch: PackedBatch, seq_len: int | None = None, pad_id: int | None = None) -> None:
    """Assert the `PackedBatch` invariants every consumer relies on."""
    T = batch.seq_len if seq_len is None else seq_len
    for name in ("input_ids", "position_ids", "doc_ids", "loss_mask"):
        t = getattr(batch, name)
        assert t.shape == (T,) and t.dtype == torch.long, f"{name}: {tuple(t.shape)} {t.dtype}, want [{T}]"
    valid = batch.num_valid_tokens
    assert int((batch.doc_ids >= 0).sum()) == valid, "num_valid_tokens disagrees with doc_ids"
    assert bool((batch.doc_ids[:valid] >= 0).all()), "padding must come after every document"
    pad = slice(valid, T)
    assert bool((batch.doc_ids[pad] == -1).all()) and bool((batch.loss_mask[pad] == 0).all())
    assert bool((batch.position_ids[pad] == 0).all())
    if pad_id is not None:
        assert bool((batch.input_ids[pad] == pad_id).all()), "padding input_ids must be pad_id"
    assert set(batch.loss_mask.unique().tolist()) <= {0, 1}, "loss_mask must be 0/1"
    docs = batch.doc_ids[:valid]
    counts = torch.bincount(docs, minlength=batch.num_docs) if valid else torch.zeros(0, dtype=torch.long)
    assert counts.numel() == batch.num_docs and bool((counts > 0).all()), "doc ids must be 0..num_docs-1"
    assert bool((docs[1:] >= docs[:-1]).all()) and bool((docs[1:] - docs[:-1] <= 1).all()), \
        "each document must be one contiguous run, in order"
    starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]]) if valid else counts
    expected = torch.arange(valid) - starts.repeat_interleave(counts)
    assert torch.equal(batch.position_ids[:valid], expected), "positions must restart at 0 per document"
