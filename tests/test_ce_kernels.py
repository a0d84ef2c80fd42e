"""The Triton CE kernels (train.loss_kernel=triton) against PyTorch: statistics, argmax ties,
the in-place gradient, and the whole fused CE, for each statistics kernel. On CUDA, and on CPU
through Triton's interpreter wherever the triton package is installed (the CPU build of torch
comes without it)."""

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

import triton_interp
from dflash_mp.model import ce_kernels
from dflash_mp.model.loss import fused_linear_cross_entropy

HAS_TRITON = triton_interp.triton_path() == ""  # importable here, not only in the side install


# ce_kernels settings per case: each statistics kernel, over lanes of several widths, and the
# gradient pass with several tiles per program (4096 x 2 and 1024 x 3 over 9000 logits: the last
# program's span runs past the vocabulary, its last tile partial).
CASES = {
    "lanes": dict(STATS="lanes", STATS_BLOCK=1024),
    "lanes-4096-2stages": dict(STATS="lanes", STATS_BLOCK=4096, STATS_STAGES=2, GRAD_TILES=2),
    "lanes-tilemax": dict(STATS="lanes-tilemax", STATS_BLOCK=2048, BLOCK_V=1024, GRAD_TILES=3),
    "tiles": dict(STATS="tiles", STATS_BLOCK=4096),
}


@contextlib.contextmanager
def settings(**values):
    """ce_kernels' module settings changed to `values` inside the block."""
    old = {k: getattr(ce_kernels, k) for k in values}
    for k, v in values.items():
        setattr(ce_kernels, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(ce_kernels, k, v)


def _inputs(device, block, rows=37, vocab=9000, hidden=64):
    """bf16 logits over several `block`-wide tiles with a partial last one (9000 is no multiple
    of a power of 2), a label in the last column, and rows built to catch a wrong argmax or sum;
    row -> its argmax."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g).bfloat16().to(device)
    w = torch.randn(vocab, hidden, generator=g).bfloat16().to(device)
    y = torch.randint(0, vocab, (rows,), generator=g).to(device)
    y[5] = vocab - 1
    logits = F.linear(h, w)
    argmax = {}

    def tie(row, *cols):
        logits[row, list(cols)] = logits[row].max() + 4
        argmax[row] = min(cols)

    tie(2, 100, block + 20)  # across tiles and lanes: the first index wins from the higher lane
    tie(3, 17, 18)  # within a tile
    tie(4, vocab - 2)  # alone, in the partial last tile
    tie(6, 33, 33 + block, 33 + 2 * block)  # in one lane of three tiles
    tie(8, vocab - 3 - block, vocab - 3)  # in one lane of a whole tile and the partial one
    logits[7] = 1.5  # all equal: the first index, lse = 1.5 + log(vocab)
    argmax[7] = 0
    logits[9, : block - 1] = float("-inf")  # lanes that start at -inf,
    logits[9, 5::block] = float("-inf")  # and one that stays there
    return h, w, y, logits, argmax


def check(device: str, case: str) -> None:
    with settings(**CASES[case]):
        check_stats_and_grad(device)
        check_fused_ce(device)
        if ce_kernels.STATS != "tiles":  # the old kernel's running maximum starts at -inf: NaN here
            check_infinite_rows(device)


def check_stats_and_grad(device: str) -> None:
    h, w, y, logits, argmax = _inputs(device, ce_kernels.STATS_BLOCK)
    lf = logits.float()
    ce, pred, lse = ce_kernels.ce_stats(logits, y)
    ref_lse = torch.logsumexp(lf, -1)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ce, ref_lse - lf.gather(1, y[:, None])[:, 0], rtol=1e-6, atol=1e-5)
    assert torch.equal(pred, lf.argmax(-1)) and all(pred[r] == i for r, i in argmax.items()), pred

    grad = ce_kernels.softmax_grad_(logits, y, lse)
    assert grad.data_ptr() == logits.data_ptr() and grad.dtype == torch.bfloat16  # in place
    ref = torch.exp(lf - ref_lse[:, None]) - F.one_hot(y, lf.shape[1])
    # One bf16 rounding of the same fp32 value (the interpreter truncates where CUDA rounds).
    torch.testing.assert_close(grad.float(), ref, rtol=2**-7, atol=1e-6)


def check_fused_ce(device: str) -> None:
    """The whole fused CE, 2 chunks of 20 and 17 rows: CE, argmax and d ce / d hidden as eager's."""
    h, w, y, _, _ = _inputs(device, ce_kernels.STATS_BLOCK)
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


def check_infinite_rows(device: str) -> None:
    """A row of -inf (lse -inf, argmax 0, as torch's) and one finite only in its last column."""
    logits = torch.full((2, 9000), float("-inf"), dtype=torch.bfloat16, device=device)
    logits[1, -1] = 3.0
    _, pred, lse = ce_kernels.ce_stats(logits, torch.zeros(2, dtype=torch.long, device=device))
    assert lse.tolist() == [float("-inf"), 3.0] and pred.tolist() == [0, 8999]


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("case", CASES)
def test_kernels_match_pytorch_on_cuda(case):
    check("cuda", case)


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
@pytest.mark.parametrize("case", CASES)
def test_kernels_match_pytorch_in_the_triton_interpreter(case):
    run = triton_interp.run("test_ce_kernels", f"check('cpu', {case!r})", timeout=600)
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
