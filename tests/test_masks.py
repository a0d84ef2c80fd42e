"""The one mask_mod against a naive reference, and the two backends against each other."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from dflash_mp.block_mask import build_block_mask, mask_grid
from dflash_mp.model.attention import BlockAttention, build_block_attention, make_mask_mod


def packed_row(doc_lens: list[int], pad: int) -> torch.Tensor:
    """doc_ids of one packed row: documents back to back, then `pad` padding tokens."""
    parts = [torch.full((n,), d, dtype=torch.long) for d, n in enumerate(doc_lens)]
    return torch.cat(parts + [torch.full((pad,), -1, dtype=torch.long)])


def doc_bounds(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of every document."""
    out = []
    for d in range(int(doc_ids.max()) + 1):
        idx = (doc_ids == d).nonzero().flatten()
        out.append((int(idx[0]), int(idx[-1]) + 1))
    return out


def naive_mask(anchors, valid, doc_ids, B, window):
    """Element-by-element reference, written from the rules and not from mask_mod."""
    T, A = doc_ids.shape[0], anchors.shape[0]
    anchors, valid, doc = anchors.tolist(), valid.tolist(), doc_ids.tolist()
    out = torch.zeros(A * B, T + A * B, dtype=torch.bool)
    for i in range(A):
        a = anchors[i]
        for k in range(B):
            q = i * B + k
            for p in range(T):
                ok = valid[i] and doc[p] >= 0 and doc[p] == doc[a] and p < a
                if window is not None:
                    ok = ok and (a + k) - p < window
                out[q, p] = ok
            for j in range(B):
                ok = True if window is None else (j <= k and k - j < window)
                out[q, T + i * B + j] = ok
    return out


def make_case(B: int, seed: int):
    """Many documents, padding, anchors at document starts and last tokens, invalid anchors."""
    g = torch.Generator().manual_seed(seed)
    doc_lens = [int(x) for x in torch.randint(1, 14, (6,), generator=g)] + [1, 2]
    # At least 5 padding tokens, and T a multiple of 16 so block keys start on a flex tile edge.
    pad = 5 + (-(sum(doc_lens) + 5)) % 16
    doc_ids = packed_row(doc_lens, pad=pad)
    bounds = doc_bounds(doc_ids)
    valid_anchors = sorted({s for s, _ in bounds[:3]} | {e - 1 for _, e in bounds[2:6]} | {bounds[1][0] + 1})
    valid_anchors = [a for a in valid_anchors if a < bounds[-1][1]]
    invalid = [0, 0, 3]
    anchors = torch.tensor(valid_anchors + invalid)
    valid = torch.tensor([True] * len(valid_anchors) + [False] * len(invalid))
    return anchors, valid, doc_ids


@pytest.mark.parametrize("B", [8, 10, 16])
@pytest.mark.parametrize("window", [None, 3, 7, 40])
@pytest.mark.parametrize("seed", [0, 1])
def test_mask_mod_matches_naive_reference(B, window, seed):
    anchors, valid, doc_ids = make_case(B, seed)
    T, Q = doc_ids.shape[0], anchors.shape[0] * B
    mask_mod = make_mask_mod(anchors, valid, doc_ids, T, B, window)
    dense = create_mask(mask_mod, 1, 1, Q, T + Q, "cpu")[0, 0]
    ref = naive_mask(anchors, valid, doc_ids, B, window)
    assert torch.equal(dense, ref)
    # The dense backend's grid (one broadcast evaluation) is create_mask's vmapped one.
    assert torch.equal(mask_grid(mask_mod, Q, T + Q, "cpu"), ref)
    # Every query row sees at least its own slot 0, so no softmax row is empty.
    assert dense.any(dim=1).all()
    if window is not None and window < B:
        assert not torch.equal(ref, naive_mask(anchors, valid, doc_ids, B, None))


def test_mask_semantics_by_hand():
    # doc 0 = positions 0..4, doc 1 = 5..9, padding 10..11.  B = 4.
    doc_ids = packed_row([5, 5], pad=2)
    anchors, valid = torch.tensor([3, 5, 9, 0]), torch.tensor([True, True, True, False])
    T, B = 12, 4
    full = create_mask(make_mask_mod(anchors, valid, doc_ids, T, B, None), 1, 1, 16, 28, "cpu")[0, 0]
    ctx = full[:, :T]
    assert ctx[0:4].nonzero()[:, 1].unique().tolist() == [0, 1, 2]  # strictly before anchor 3
    assert not ctx[4:8].any()  # anchor at a document start sees no context
    assert ctx[8:12].nonzero()[:, 1].unique().tolist() == [5, 6, 7, 8]  # own doc only
    assert not ctx[12:16].any()  # invalid anchor
    blocks = full[:, T:]
    assert torch.equal(blocks, torch.block_diag(*[torch.ones(4, 4, dtype=torch.bool)] * 4))
    slide = create_mask(make_mask_mod(anchors, valid, doc_ids, T, B, 3), 1, 1, 16, 28, "cpu")[0, 0]
    # Slot k of the block anchored at 9 sees context p with 9 + k - p < 3 -> p in {8} for k=0,
    # nothing for k >= 2; in-block: causal and within the window.
    assert slide[8, :T].nonzero().flatten().tolist() == [7, 8]
    assert slide[9, :T].nonzero().flatten().tolist() == [8]
    assert not slide[10, :T].any()
    assert slide[11, T + 8 : T + 12].tolist() == [False, True, True, True]


def test_mask_mod_closes_over_tensors_and_run_constants_only():
    anchors, valid, doc_ids = make_case(16, 0)
    T = doc_ids.shape[0]
    mask_mod = make_mask_mod(anchors, valid, doc_ids, T, 16, 5)
    cells = [c.cell_contents for c in mask_mod.__closure__]
    ints = sorted(c for c in cells if isinstance(c, int))
    assert all(isinstance(c, (torch.Tensor, int)) for c in cells)
    assert ints == sorted([T, 16, 5])


def block_sets(block_mask, num_q_blocks):
    """(partial, full) sets of (q_block, kv_block) pairs from a BlockMask."""
    partial, full = set(), set()
    for qb in range(num_q_blocks):
        n = int(block_mask.kv_num_blocks[0, 0, qb])
        partial |= {(qb, int(kb)) for kb in block_mask.kv_indices[0, 0, qb, :n]}
        n = int(block_mask.full_kv_num_blocks[0, 0, qb])
        full |= {(qb, int(kb)) for kb in block_mask.full_kv_indices[0, 0, qb, :n]}
    return partial, full


@pytest.mark.parametrize("B,window", [(8, None), (10, 4), (16, None), (16, 7)])
def test_block_mask_consistent_with_dense(B, window):
    anchors, valid, doc_ids = make_case(B, 3)
    T, Q = doc_ids.shape[0], anchors.shape[0] * B
    KV, S = T + Q, 16
    mask_mod = make_mask_mod(anchors, valid, doc_ids, T, B, window)
    dense = create_mask(mask_mod, 1, 1, Q, KV, "cpu")[0, 0]
    block_mask = create_block_mask(mask_mod, None, None, Q, KV, device="cpu", BLOCK_SIZE=S)
    nq, nk = -(-Q // S), -(-KV // S)
    partial, full = block_sets(block_mask, nq)
    assert not partial & full
    if B == S and window is None:
        # Tiles on the block diagonal are whole blocks, which see all of their own block.
        assert {(i, T // S + i) for i in range(nq)} <= full
    for qb in range(nq):
        for kb in range(nk):
            tile = dense[qb * S : (qb + 1) * S, kb * S : (kb + 1) * S]
            if (qb, kb) in full:
                assert tile.all()
            elif (qb, kb) in partial:
                assert tile.any()
            else:
                assert not tile.any()


@pytest.mark.parametrize("window", [None, 5])
def test_flex_forward_matches_dense_sdpa(window):
    anchors, valid, doc_ids = make_case(8, 4)
    T, Q, B = doc_ids.shape[0], anchors.shape[0] * 8, 8
    layer_types = ["sliding_attention"] if window else ["full_attention"]
    kwargs = dict(layer_types=layer_types, sliding_window=window)
    dense = build_block_attention(anchors, valid, doc_ids, B, backend="dense", **kwargs)
    flex = build_block_attention(anchors, valid, doc_ids, B, backend="flex", flex_block_size=16, **kwargs)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(Q, 4, 16, generator=g)  # [S, heads, D], the projections' layout
    k = torch.randn(T + Q, 2, 16, generator=g)
    v = torch.randn(T + Q, 2, 16, generator=g)
    with torch.no_grad(), warnings.catch_warnings():
        # Eager flex on CPU warns that it is unfused; comparing that path is the point here.
        warnings.simplefilter("ignore", UserWarning)
        out_dense = dense(q, k, v, sliding=window is not None)
        out_flex = flex(q, k, v, sliding=window is not None)
    torch.testing.assert_close(out_flex, out_dense, atol=1e-5, rtol=1e-5)


def test_build_block_attention_builds_one_mask_per_kind():
    anchors, valid, doc_ids = make_case(8, 0)
    both = build_block_attention(
        anchors, valid, doc_ids, 8, layer_types=["full_attention", "sliding_attention"], sliding_window=4,
        backend="dense",
    )
    assert isinstance(both, BlockAttention) and both.backend == "dense"
    assert both.full is not None and both.sliding is not None
    assert not torch.equal(both.full, both.sliding)
    only_full = build_block_attention(anchors, valid, doc_ids, 8, backend="auto")
    assert only_full.sliding is None and only_full.backend == "dense"  # auto on CPU
    with pytest.raises(ValueError, match="sliding_window"):
        build_block_attention(anchors, valid, doc_ids, 8, layer_types=["sliding_attention"], backend="dense")
    with pytest.raises(ValueError, match="drafter.attention='flash'"):
        build_block_attention(anchors, valid, doc_ids, 8, backend="flash")
    if not os.environ.get("TRITON_INTERPRET"):  # the Triton kernels have no CPU form outside the interpreter
        with pytest.raises(ValueError, match="drafter.attention=triton needs CUDA"):
            build_block_attention(anchors, valid, doc_ids, 8, backend="triton")


BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("B,window,S", [(8, None, 16), (10, 4, 16), (16, None, 16), (16, 7, (16, 32)), (16, None, 128)])
def test_build_block_mask_equals_create_block_mask_field_by_field(B, window, S):
    """Ragged lengths included (Q=88 in tiles of 16, KV=224 in tiles of 128); B=16 in tiles of 16 has
    full tiles (each block's own keys), which the kernel runs without the mask_mod."""
    anchors, valid, doc_ids = make_case(B, 3)
    T, Q = doc_ids.shape[0], anchors.shape[0] * B
    mask_mod = make_mask_mod(anchors, valid, doc_ids, T, B, window)
    want = create_block_mask(mask_mod, None, None, Q, T + Q, device="cpu", BLOCK_SIZE=S)
    got = build_block_mask(mask_mod, Q, T + Q, "cpu", S)
    for field in BLOCK_MASK_FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.BLOCK_SIZE == want.BLOCK_SIZE and got.seq_lengths == want.seq_lengths
    assert got.mask_mod is mask_mod
    if (B, window, S) == (16, None, 16):
        assert int(want.full_kv_num_blocks.sum()) >= Q // S


def test_compiled_block_mask_does_not_recompile_across_steps():
    """New anchors and doc ids every step (same shapes): one compile, then none, for both mask kinds."""
    torch._dynamo.reset()
    T, A, B = 48, 4, 8
    Q = A * B

    def step(seed, window):
        g = torch.Generator().manual_seed(seed)
        doc_ids = torch.sort(torch.randint(0, 4, (T,), generator=g)).values
        anchors = torch.sort(torch.randint(0, T, (A,), generator=g)).values
        valid = torch.rand(A, generator=g) > 0.3
        mask_mod = make_mask_mod(anchors, valid, doc_ids, T, B, window)
        got = build_block_mask(mask_mod, Q, T + Q, "cpu", 16, compiled=True)
        want = create_block_mask(mask_mod, None, None, Q, T + Q, device="cpu", BLOCK_SIZE=16)
        for field in BLOCK_MASK_FIELDS:
            assert torch.equal(getattr(got, field), getattr(want, field)), field

    step(0, None)
    step(1, 5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(2, 5):
            step(seed, None)
            step(seed, 5)
