"""Packing: fixed shapes, per-document positions, padding rules, whole documents only."""

import random

import pytest
import torch

from dflash_mp.batch import PackedBatch
from dflash_mp.data import check_batch, pack_rows, plan_batches

T, PAD = 32, 7


def doc(n: int, tag: int) -> tuple[list[int], list[int]]:
    """A document whose tokens all equal `tag` (so it can be recognised after packing)."""
    return [tag] * n, [(j % 3 != 0) * 1 for j in range(n)]


def test_pack_layout():
    rows = [doc(5, 100), doc(3, 200), doc(10, 300)]
    b = pack_rows(rows, T, PAD)
    check_batch(b, seq_len=T, pad_id=PAD)
    assert b.num_docs == 3 and b.num_valid_tokens == 18
    assert b.doc_ids.tolist() == [0] * 5 + [1] * 3 + [2] * 10 + [-1] * 14
    assert b.position_ids.tolist() == list(range(5)) + list(range(3)) + list(range(10)) + [0] * 14
    assert b.input_ids.tolist() == [100] * 5 + [200] * 3 + [300] * 10 + [PAD] * 14
    assert b.loss_mask.tolist() == rows[0][1] + rows[1][1] + rows[2][1] + [0] * 14


def test_every_batch_has_the_same_shape():
    batches = ([doc(1, 1)], [doc(T, 2)], [doc(4, 3)] * 8)
    shapes = {tuple(pack_rows(rows, T, PAD).input_ids.shape) for rows in batches}
    assert shapes == {(T,)}
    empty = pack_rows([], T, PAD)
    check_batch(empty, seq_len=T, pad_id=PAD)
    assert empty.num_docs == 0 and empty.num_valid_tokens == 0


def test_overlong_document_is_truncated_and_alone():
    lengths = [10, 100, 5]
    plan = plan_batches(lengths, T, range(3))
    assert plan == [[0], [1], [2]]
    b = pack_rows([doc(100, 9)], T, PAD)
    check_batch(b, seq_len=T, pad_id=PAD)
    assert b.num_valid_tokens == T and b.position_ids.tolist() == list(range(T))


def test_rows_that_overflow_are_an_error():
    with pytest.raises(AssertionError):
        pack_rows([doc(20, 1), doc(20, 2)], T, PAD)


@pytest.mark.parametrize("num_open", [1, 3, 8])
def test_plan_covers_every_row_once_within_budget(num_open):
    rng = random.Random(num_open)
    lengths = [rng.choice([1, 2, 5, 9, 17, 31, 32, 40, 90]) for _ in range(300)]
    order = list(range(300))
    rng.shuffle(order)
    plan = plan_batches(lengths, T, order, num_open)
    assert sorted(i for row in plan for i in row) == list(range(300))
    assert all(row and sum(min(lengths[i], T) for i in row) <= T for row in plan)
    assert all(len(row) == 1 for row in plan if any(lengths[i] >= T for i in row))
    assert plan == plan_batches(lengths, T, order, num_open)  # deterministic
    for row in plan:
        b = pack_rows([doc(lengths[i], i) for i in row], T, PAD)
        check_batch(b, seq_len=T, pad_id=PAD)
        # No document is split: each doc's tokens appear as one run of min(len, T) tokens.
        for d, i in enumerate(row):
            assert int((b.doc_ids == d).sum()) == min(lengths[i], T)
            assert bool((b.input_ids[b.doc_ids == d] == i).all())


def test_next_fit_keeps_the_given_order():
    lengths = [10, 10, 20, 5, 30, 2]
    plan = plan_batches(lengths, T, range(6))
    assert plan == [[0, 1], [2, 3], [4, 5]]
    assert [i for row in plan for i in row] == list(range(6))


def test_open_rows_reduce_padding():
    rng = random.Random(0)
    lengths = [rng.randint(1, T) for _ in range(500)]
    one, eight = (len(plan_batches(lengths, T, range(500), k)) for k in (1, 8))
    assert eight < one * 0.9


@pytest.mark.parametrize("corrupt", ["pad_doc", "split_doc", "position", "mask_on_pad", "shape"])
def test_check_batch_catches_broken_batches(corrupt):
    b = pack_rows([doc(5, 1), doc(4, 2)], T, PAD)
    fields = {k: getattr(b, k).clone() for k in ("input_ids", "position_ids", "doc_ids", "loss_mask")}
    if corrupt == "pad_doc":
        fields["doc_ids"][20] = 0
    elif corrupt == "split_doc":
        fields["doc_ids"][:9] = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 1])
    elif corrupt == "position":
        fields["position_ids"][6] = 5
    elif corrupt == "mask_on_pad":
        fields["loss_mask"][30] = 1
    else:
        fields = {k: v[:-1] for k, v in fields.items()}
    bad = PackedBatch(**fields, num_docs=2, num_valid_tokens=9)
    with pytest.raises(AssertionError):
        check_batch(bad, seq_len=T, pad_id=PAD)
