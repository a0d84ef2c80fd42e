"""Fused linear + CE against a plain reference, slot weights, and block metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_mp.model.loss import block_metrics, dflash_loss, fused_linear_cross_entropy, slot_weights


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_fused_ce_matches_cross_entropy(dtype, tol, chunk_size):
    g = torch.Generator().manual_seed(0)
    N, H, V = 45, 24, 97
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    row_w = torch.rand(N, generator=g, dtype=dtype)

    ce, pred = fused_linear_cross_entropy(hidden, weight, labels, chunk_size)
    (ce * row_w).sum().backward()
    got_grad, hidden.grad = hidden.grad, None

    logits = hidden @ weight.T
    ref = F.cross_entropy(logits, labels, reduction="none")
    (ref * row_w).sum().backward()
    torch.testing.assert_close(ce, ref.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_grad, hidden.grad, atol=tol, rtol=tol)
    assert torch.equal(pred, logits.argmax(-1))


def test_compiled_ce_chunks_match_eager():
    """train.loss_kernel=inductor: the torch.compile'd chunk gives the eager chunk's CE, argmax and
    gradient (two chunk shapes, so two graphs, and no recompiles on a second pass)."""
    from dflash_mp.compile_stats import counts

    g = torch.Generator().manual_seed(0)
    N, H, V = 45, 24, 97
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    row_w = torch.rand(N, generator=g)

    def run(compiled: bool):
        h = hidden.clone().requires_grad_()
        ce, pred = fused_linear_cross_entropy(h, weight, labels, 32, kernel="inductor" if compiled else "eager")
        (ce * row_w).sum().backward()
        return ce.detach(), pred, h.grad

    eager = run(False)
    before = counts()["graphs"]
    first = run(True)
    graphs = counts()["graphs"]
    assert graphs > before  # the chunk really was compiled
    second = run(True)
    assert counts()["graphs"] == graphs
    for a, b, c in zip(eager, first, second):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)


def test_fused_ce_gives_frozen_head_no_grad_and_skips_grad_without_it():
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    ce, _ = fused_linear_cross_entropy(hidden, weight, torch.zeros(6, dtype=torch.long), 4)
    ce.sum().backward()
    assert weight.grad is None and hidden.grad is not None
    with torch.no_grad():
        ce, _ = fused_linear_cross_entropy(hidden, weight, torch.zeros(6, dtype=torch.long), 4)
    assert not ce.requires_grad


def test_slot_weights():
    w = slot_weights(16)
    assert w.shape == (16,) and w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[8]), math.exp(-7 / 7), rel_tol=1e-6)
    assert math.isclose(float(slot_weights(10)[6]), math.exp(-5 / 5), rel_tol=1e-6)
    assert math.isclose(float(slot_weights(8)[5]), math.exp(-4 / 4), rel_tol=1e-6)
    assert math.isclose(float(slot_weights(12, gamma=2.0)[3]), math.exp(-1), rel_tol=1e-6)
    assert (slot_weights(16)[1:].diff() < 0).all()
    with pytest.raises(ValueError, match="gamma"):
        slot_weights(12)


def reference_loss(block_hidden, weight, labels, label_mask, weights):
    A, B = labels.shape
    logits = block_hidden.view(A, B, -1) @ weight.T
    ce = F.cross_entropy(logits.reshape(A * B, -1), labels.reshape(-1), reduction="none").view(A, B)
    w = weights[None, :].to(ce.dtype) * label_mask.to(ce.dtype)
    w[:, 0] = 0
    return (ce * w).sum() / w.sum()


def test_dflash_loss_matches_reference_value_and_grad():
    g = torch.Generator().manual_seed(1)
    A, B, H, V = 5, 8, 16, 40
    h = torch.randn(A * B, H, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (A, B), generator=g)
    mask = torch.rand(A, B, generator=g) > 0.3
    mask[:, 0] = False
    weights = slot_weights(B).double()

    loss, correct = dflash_loss(h, W, labels, mask, weights, chunk_size=6)
    loss.backward()
    grad, h.grad = h.grad, None
    ref = reference_loss(h, W, labels, mask, weights)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(grad, h.grad, atol=1e-10, rtol=1e-10)
    # Slot 0 rows are never part of the loss.
    assert h.grad.view(A, B, H)[:, 0].abs().max() == 0
    assert correct.shape == (A, B) and not correct[:, 0].any()
    pred = (h.view(A, B, H) @ W.T).argmax(-1)
    assert torch.equal(correct[:, 1:], pred[:, 1:] == labels[:, 1:])


def test_dflash_loss_weights_and_mask():
    g = torch.Generator().manual_seed(2)
    A, B, H, V = 3, 4, 8, 20
    h = torch.randn(A * B, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (A, B), generator=g)
    mask = torch.ones(A, B, dtype=torch.bool)
    uniform = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    only_slot2 = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    logits = (h.view(A, B, H) @ W.T)
    ce = F.cross_entropy(logits.reshape(A * B, V), labels.reshape(-1), reduction="none").view(A, B)
    loss, _ = dflash_loss(h, W, labels, mask, uniform)
    torch.testing.assert_close(loss, ce[:, 1:].mean())
    loss, _ = dflash_loss(h, W, labels, mask, only_slot2)
    torch.testing.assert_close(loss, ce[:, 2].mean())
    # A masked label changes nothing, whatever it is.
    mask[1, 3] = False
    base, _ = dflash_loss(h, W, labels, mask, uniform)
    labels2 = labels.clone()
    labels2[1, 3] = (labels[1, 3] + 1) % V
    assert torch.equal(base, dflash_loss(h, W, labels2, mask, uniform)[0])
    # Nothing supervised: finite zero loss (and zero gradients), not NaN.
    hz = h.clone().requires_grad_()
    zero, _ = dflash_loss(hz, W, labels, torch.zeros_like(mask), uniform)
    zero.backward()
    assert zero == 0 and hz.grad.abs().max() == 0


def test_dflash_loss_compiles_without_graph_breaks():
    g = torch.Generator().manual_seed(3)
    A, B, H, V = 4, 8, 16, 30
    h = torch.randn(A * B, H, generator=g, requires_grad=True)
    W = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (A, B), generator=g)
    mask = torch.rand(A, B, generator=g) > 0.2
    weights = slot_weights(B)
    eager, eager_correct = dflash_loss(h, W, labels, mask, weights, chunk_size=10)
    eager.backward()
    eager_grad, h.grad = h.grad, None
    compiled = torch.compile(dflash_loss, backend="aot_eager", fullgraph=True)
    loss, correct = compiled(h, W, labels, mask, weights, chunk_size=10)
    loss.backward()
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(h.grad, eager_grad)
    assert torch.equal(correct, eager_correct)


def test_block_metrics_hand_made():
    T, F_ = True, False
    # B = 5. Block 0: slots 1,2 right, 3 wrong -> tau 3. Block 1: slot 1 wrong -> tau 1.
    # Block 2: all right but slot 3 unsupervised -> leading run stops at slot 3 -> tau 3.
    # Block 3: nothing supervised (invalid anchor) -> excluded from the mean.
    correct = torch.tensor(
        [
            [F_, T, T, F_, T],
            [F_, F_, T, T, T],
            [F_, T, T, T, T],
            [F_, T, T, T, T],
        ]
    )
    mask = torch.tensor(
        [
            [F_, T, T, T, T],
            [F_, T, T, T, T],
            [F_, T, T, F_, T],
            [F_, F_, F_, F_, F_],
        ]
    )
    m = block_metrics(correct, mask)
    assert set(m) == {"acc_slot_1", "acc_slot_2", "acc_slot_3", "acc_slot_4", "tau_sim"}
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in m.values())
    torch.testing.assert_close(m["tau_sim"], torch.tensor((3 + 1 + 3) / 3))
    torch.testing.assert_close(m["acc_slot_1"], torch.tensor(2 / 3))
    torch.testing.assert_close(m["acc_slot_2"], torch.tensor(1.0))
    torch.testing.assert_close(m["acc_slot_3"], torch.tensor(1 / 2))  # block 2 slot 3 unsupervised
    torch.testing.assert_close(m["acc_slot_4"], torch.tensor(1.0))


def test_block_metrics_all_correct_reaches_block_size():
    A, B = 6, 16
    mask = torch.ones(A, B, dtype=torch.bool)
    mask[:, 0] = False
    correct = mask.clone()
    assert block_metrics(correct, mask)["tau_sim"] == B
    assert block_metrics(torch.zeros_like(mask), mask)["tau_sim"] == 1
