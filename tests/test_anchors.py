"""Anchor sampling rules, block inputs and block labels."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dflash_mp.model.anchors import anchor_candidates, block_labels, build_blocks, sample_anchors


def random_row(seed: int, T: int = 96):
    """A packed row: documents with alternating prompt / assistant spans, then padding."""
    g = torch.Generator().manual_seed(seed)
    doc_ids, loss_mask, position_ids = [], [], []
    doc = 0
    while len(doc_ids) < T - 8:
        n = int(torch.randint(2, 30, (1,), generator=g))
        n = min(n, T - 8 - len(doc_ids))
        mask = (torch.rand(n, generator=g) > 0.35).long()
        doc_ids += [doc] * n
        loss_mask += mask.tolist()
        position_ids += list(range(n))
        doc += 1
    pad = T - len(doc_ids)
    doc_ids += [-1] * pad
    loss_mask += [0] * pad
    position_ids += [0] * pad
    input_ids = torch.randint(0, 1000, (T,), generator=g)
    return input_ids, torch.tensor(position_ids), torch.tensor(doc_ids), torch.tensor(loss_mask)


def naive_candidates(loss_mask, doc_ids) -> set[int]:
    T = len(doc_ids)
    lm, doc = loss_mask.tolist(), doc_ids.tolist()
    return {a for a in range(T - 1) if lm[a] == 1 and lm[a + 1] == 1 and doc[a + 1] == doc[a] and doc[a] >= 0}


def test_candidates_match_rules():
    for seed in range(5):
        _, _, doc_ids, loss_mask = random_row(seed)
        got = set(anchor_candidates(loss_mask, doc_ids).nonzero().flatten().tolist())
        assert got == naive_candidates(loss_mask, doc_ids)
    # The last token of the row can never anchor, even if supervised.
    assert not anchor_candidates(torch.ones(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))[-1]


@pytest.mark.parametrize("num_anchors,max_per_doc", [(8, 2), (64, 3), (64, None), (200, 1), (5, None)])
def test_sampled_anchors_obey_rules(num_anchors, max_per_doc):
    for seed in range(10):
        _, _, doc_ids, loss_mask = random_row(seed)
        cands = naive_candidates(loss_mask, doc_ids)
        g = torch.Generator().manual_seed(seed)
        anchors, valid = sample_anchors(loss_mask, doc_ids, num_anchors, max_per_doc, generator=g)
        assert anchors.shape == (num_anchors,) and valid.shape == (num_anchors,)
        assert anchors.dtype == torch.int64 and valid.dtype == torch.bool
        n = int(valid.sum())
        # Valid slots first, ascending, distinct; invalid slots after them, at an in-range position.
        assert valid[:n].all() and not valid[n:].any()
        chosen = anchors[:n].tolist()
        assert chosen == sorted(set(chosen))
        assert set(chosen) <= cands
        assert (anchors[n:] >= 0).all() and (anchors[n:] < doc_ids.shape[0]).all()
        per_doc = Counter(int(doc_ids[a]) for a in chosen)
        cand_per_doc = Counter(int(doc_ids[a]) for a in cands)
        cap = max_per_doc if max_per_doc is not None else 10**9
        assert all(c <= cap for c in per_doc.values())
        expected = min(num_anchors, sum(min(cap, c) for c in cand_per_doc.values()))
        assert n == expected


def test_every_candidate_is_reachable_with_the_expected_frequency():
    _, _, doc_ids, loss_mask = random_row(7)
    cands = naive_candidates(loss_mask, doc_ids)
    A, cap, draws = 6, 2, 1000
    counts = Counter()
    g = torch.Generator().manual_seed(0)
    for _ in range(draws):
        anchors, valid = sample_anchors(loss_mask, doc_ids, A, cap, generator=g)
        counts.update(anchors[valid].tolist())
    assert set(counts) == cands
    # Two uniform draws: min(cap, n_d) of a document's n_d candidates, then A of the pool.
    n_doc = Counter(int(doc_ids[c]) for c in cands)
    pool = sum(min(cap, n) for n in n_doc.values())
    for c in cands:
        n = n_doc[int(doc_ids[c])]
        expected = draws * min(cap, n) / n * min(1.0, A / pool)
        assert abs(counts[c] - expected) < 0.35 * expected + 10, (c, counts[c], expected)


def test_per_doc_draw_is_uniform_inside_a_document():
    # One document, 6 candidates, cap 2, A large: each pair of candidates equally likely.
    doc_ids = torch.zeros(8, dtype=torch.long)
    loss_mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1])
    g = torch.Generator().manual_seed(1)
    counts = Counter()
    for _ in range(1500):
        anchors, valid = sample_anchors(loss_mask, doc_ids, 4, 2, generator=g)
        assert int(valid.sum()) == 2
        counts.update(anchors[valid].tolist())
    assert set(counts) == {1, 2, 3, 4, 5, 6}
    assert all(abs(c - 500) < 120 for c in counts.values())


def test_no_candidates_gives_all_invalid():
    zeros = torch.zeros(16, dtype=torch.long)
    anchors, valid = sample_anchors(zeros, zeros, 4, 2)
    assert not valid.any() and anchors.shape == (4,)


def test_same_generator_seed_same_anchors():
    _, _, doc_ids, loss_mask = random_row(3)
    a1 = sample_anchors(loss_mask, doc_ids, 10, 2, generator=torch.Generator().manual_seed(5))
    a2 = sample_anchors(loss_mask, doc_ids, 10, 2, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])


def test_build_blocks():
    input_ids = torch.arange(100, 120)
    position_ids = torch.tensor(list(range(8)) + list(range(12)))
    anchors = torch.tensor([2, 9, 0])
    block_ids, block_pos = build_blocks(input_ids, position_ids, anchors, 4, mask_token_id=7)
    assert block_ids.tolist() == [102, 7, 7, 7, 109, 7, 7, 7, 100, 7, 7, 7]
    # Positions continue from the anchor's own (per-document) position.
    assert block_pos.tolist() == [2, 3, 4, 5, 1, 2, 3, 4, 0, 1, 2, 3]


def test_block_labels_match_naive():
    B = 8
    for seed in range(5):
        input_ids, _, doc_ids, loss_mask = random_row(seed)
        T = doc_ids.shape[0]
        gen = torch.Generator().manual_seed(seed)
        anchors, valid = sample_anchors(loss_mask, doc_ids, 12, 3, generator=gen)
        # Include an anchor near the row end to exercise a + k >= T.
        anchors[-1], valid[-1] = T - 3, True
        labels, mask = block_labels(input_ids, loss_mask, doc_ids, anchors, valid, B)
        assert labels.shape == mask.shape == (12, B) and labels.dtype == torch.int64
        for i, (a, ok) in enumerate(zip(anchors.tolist(), valid.tolist())):
            for k in range(B):
                t = a + k
                want = ok and k >= 1 and t < T and doc_ids[t] == doc_ids[a] and loss_mask[t] == 1
                assert bool(mask[i, k]) == bool(want), (i, k)
                if want:
                    assert labels[i, k] == input_ids[t]
        assert not mask[:, 0].any()


def test_no_graph_breaks_under_compile():
    _, position_ids, doc_ids, loss_mask = random_row(0)
    input_ids = torch.arange(doc_ids.shape[0])

    def step(input_ids, position_ids, doc_ids, loss_mask):
        anchors, valid = sample_anchors(loss_mask, doc_ids, 16, 3)
        blocks = build_blocks(input_ids, position_ids, anchors, 8, 5)
        labels = block_labels(input_ids, loss_mask, doc_ids, anchors, valid, 8)
        return anchors, valid, blocks, labels

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    anchors, valid, _, (labels, mask) = compiled(input_ids, position_ids, doc_ids, loss_mask)
    assert set(anchors[valid].tolist()) <= naive_candidates(loss_mask, doc_ids)
    assert (mask.sum(1) > 0).eq(valid).all()
