"""The Triton CE kernels (train.loss_kernel=triton) against PyTorch: statistics, argmax ties,
the in-place gradient, and the whole fused CE. On CUDA, and on CPU through Triton's interpreter
wherever the triton package is installed (the CPU build of torch comes without it)."""

import os

import pytest
import torch
import torch.nn.functional as F

import triton_interp
from dflash_mp.model import ce_kernels
from dflash_mp.model.loss import fused_linear_cross_entropy

HAS_TRITON = triton_interp.triton_path() == ""  # importable here, not only in the side install


def _inputs(device, rows=37, vocab=9000, hidden=64):
    """bf16 logits of several tiles with a partial last one, a tie for the maximum, a maximum in
    the last tile and a label in the last column."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g).bfloat16().to(device)
    w = torch.randn(vocab, hidden, generator=g).bfloat16().to(device)
    y = torch.randint(0, vocab, (rows,), generator=g).to(device)
    y[5] = vocab - 1
    logits = F.linear(h, w)
    logits[2, 10] = logits[2, 5000] = logits[2].max() + 4  # tie across tiles: the first index wins
    logits[3, 17] = logits[3, 18] = logits[3].max() + 4  # tie within a tile
    logits[4, vocab - 2] = logits[4].max() + 4  # the maximum in the partial last tile
    return h, w, y, logits


def check(device: str) -> None:
    h, w, y, logits = _inputs(device)
    lf = logits.float()
    ce, pred, lse = ce_kernels.ce_stats(logits, y)
    ref_lse = torch.logsumexp(lf, -1)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ce, ref_lse - lf.gather(1, y[:, None])[:, 0], rtol=1e-6, atol=1e-5)
    assert torch.equal(pred, lf.argmax(-1)) and pred[2] == 10 and pred[3] == 17 and pred[4] == logits.shape[1] - 2

    grad = ce_kernels.softmax_grad_(logits, y, lse)
    assert grad.data_ptr() == logits.data_ptr() and grad.dtype == torch.bfloat16  # in place
    ref = torch.exp(lf - ref_lse[:, None]) - F.one_hot(y, lf.shape[1])
    # One bf16 rounding of the same fp32 value (the interpreter truncates where CUDA rounds).
    torch.testing.assert_close(grad.float(), ref, rtol=2**-7, atol=1e-6)

    # The whole fused CE, 2 chunks of 20 and 17 rows: CE, argmax and d ce / d hidden as eager's.
    weights = torch.rand(h.shape[0], generator=torch.Generator().manual_seed(1)).to(device)
    out = {}
    for kernel in ("eager", "triton"):
        x = h.clone().requires_grad_()
        c, p = fused_linear_cross_entropy(x, w, y, 20, kernel=kernel)
        (c * weights).sum().backward()
        out[kernel] = (c.detach(), p, x.grad)
    torch.testing.assert_close(out["triton"][0], out["eager"][0], rtol=1e-5, atol=1e-4)
    assert torch.equal(out["triton"][1], out["eager"][1])
    got, want = out["triton"][2].float(), out["eager"][2].float()
    assert want.norm() > 0 and (got - want).norm() <= 1e-2 * want.norm(), float((got - want).norm() / want.norm())


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
def test_kernels_match_pytorch_on_cuda():
    check("cuda")


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
def test_kernels_match_pytorch_in_the_triton_interpreter():
    run = triton_interp.run("test_ce_kernels", "check('cpu')", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def test_triton_is_refused_where_it_cannot_run():
    from dflash_mp.trainer import resolve_loss_kernel

    cpu = torch.device("cpu")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="loss_kernel=triton needs CUDA"):
            resolve_loss_kernel("triton", "default", cpu)
        assert resolve_loss_kernel("auto", "default", cpu) == "eager"
    assert resolve_loss_kernel("inductor", "eager", cpu) == "inductor"
    with pytest.raises(ValueError, match="train.loss_kernel='fused'"):
        resolve_loss_kernel("fused", "default", cpu)
