"""The drafter's RMSNorm with its backward in one pass (train.norm_kernel=triton): the op's formula
against autograd of the module's ops, the Triton kernel against the formula (on CUDA, and on CPU
through Triton's interpreter where the triton package is installed), under torch.compile, and how
the setting resolves."""

import os

import pytest
import torch

import triton_interp
from dflash_mp.model import rms_norm
from dflash_mp.model.drafter import DFlashDrafter, DrafterArgs, RMSNorm
from dflash_mp.trainer import compile_objective, resolve_norm_kernel

HAS_TRITON = triton_interp.triton_path() == ""  # importable here, not only in the side install

# (input shape, normalised size): a layer's rows, the query norm's heads (3-d), a size that is no power
# of 2, and more row tiles than the interpreter's 64 programs (each program walks several).
SHAPES = [((37, 64), 64), ((9, 4, 32), 32), ((5, 100), 100), ((700, 16), 16)]


def _inputs(shape, h, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(device, dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(device, dtype)
    grad = torch.randn(*shape, generator=g).to(device, dtype)
    return x, w, grad


def _autograd(x, w, grad, eps=1e-6):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm.rms_norm(x, w, eps).backward(grad)
    return x.grad, w.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_kernel(device: str) -> None:
    """The op (the Triton kernel where it runs) against the formula, and against autograd."""
    assert rms_norm.available(torch.device(device))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for shape, h in SHAPES:
            x, w, grad = _inputs(shape, h, dtype, device)
            dx, dw = rms_norm.rms_norm_backward(grad, x, w, 1e-6)
            ref_dx, ref_dw = rms_norm.backward_reference(grad, x, w, 1e-6)
            assert dx.shape == x.shape and dx.dtype == dtype and dw.shape == w.shape and dw.dtype == dtype
            # The same fp32 arithmetic, summed in another order (the kernel's dw adds per program), and
            # rounded to bf16 at the same places: to nearest on a GPU, where Triton's interpreter
            # truncates (twice the error).
            low = 1e-6 if dtype == torch.float32 else 2e-3 if device == "cuda" else 8e-3
            assert _rel(dx, ref_dx) < low and _rel(dw, ref_dw) < low, (dtype, shape)
            auto_dx, auto_dw = _autograd(x, w, grad)
            assert _rel(dx, auto_dx) < tol and _rel(dw, auto_dw) < tol, (dtype, shape)


def test_the_formula_is_autograds_and_the_module_uses_it():
    for shape, h in SHAPES:
        x, w, grad = _inputs(shape, h, torch.float32, "cpu")
        want_dx, want_dw = _autograd(x, w, grad)
        dx, dw = rms_norm.backward_reference(grad, x, w, 1e-6)
        torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dw, want_dw, rtol=1e-5, atol=1e-5)
        norm = RMSNorm(h, 1e-6)
        norm.weight.data.copy_(w)
        norm.one_pass = True
        xg = x.clone().requires_grad_()
        out = norm(xg)
        torch.testing.assert_close(out, rms_norm.rms_norm(x, w, 1e-6), rtol=0, atol=0)
        out.backward(grad)
        torch.testing.assert_close(xg.grad, want_dx, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm.weight.grad, want_dw, rtol=1e-5, atol=1e-5)


def test_a_compiled_drafter_gives_the_same_gradients_with_either_backward():
    """A one-layer drafter's forward under torch.compile (CPU: the op's PyTorch formula inside the
    compiled backward), its every parameter's gradient against the autograd backward's."""
    args = DrafterArgs(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=128, target_layer_ids=[1, 2], block_size=4, mask_token_id=127)
    grads = {}
    for kernel in rms_norm.NORM_KERNELS:
        torch.manual_seed(0)
        drafter = DFlashDrafter(args)
        for m in drafter.modules():
            if isinstance(m, RMSNorm):
                m.one_pass = kernel == "triton"
                m.weight.data.uniform_(0.5, 1.5)
        layer = torch.compile(drafter.layers[0], fullgraph=True, dynamic=False)
        norm = torch.compile(drafter.norm, fullgraph=True, dynamic=False)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 64, generator=g, requires_grad=True)
        ctx = torch.randn(6, 64, generator=g)
        from dflash_mp.model import build_block_attention

        anchors, valid = torch.tensor([2, 4]), torch.tensor([True, True])
        attn = build_block_attention(anchors, valid, torch.zeros(6, dtype=torch.long), 4,
                                     layer_types=["full_attention"], sliding_window=None, backend="dense")
        pos_q = torch.arange(8) % 4 + anchors.repeat_interleave(4)
        rope_q = drafter.rotary_emb(pos_q, x.dtype)
        rope_c = drafter.rotary_emb(torch.arange(6), x.dtype)
        rope_k = (torch.cat([rope_c[0], rope_q[0]]), torch.cat([rope_c[1], rope_q[1]]))
        out = norm(layer(x, drafter.hidden_norm(ctx), rope_q, rope_k, attn))
        out.pow(2).sum().backward()
        grads[kernel] = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        grads[kernel]["x"] = x.grad.clone()
    assert grads["triton"].keys() == grads["autograd"].keys() and "layers.0.input_layernorm.weight" in grads["triton"]
    for name, want in grads["autograd"].items():
        torch.testing.assert_close(grads["triton"][name], want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
def test_the_kernel_matches_in_the_triton_interpreter():
    run = triton_interp.run("test_rms_norm", "check_kernel('cpu')", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
def test_the_kernel_matches_on_cuda():
    check_kernel("cuda")


def test_the_setting_resolves_and_names_the_fix():
    cpu = torch.device("cpu")
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert resolve_norm_kernel("auto", "default", cpu) == "autograd"
        with pytest.raises(ValueError, match="norm_kernel=triton needs CUDA.*use autograd"):
            resolve_norm_kernel("triton", "default", cpu)
    assert resolve_norm_kernel("autograd", "default", cpu) == "autograd"
    with pytest.raises(ValueError, match="train.norm_kernel='fused': use auto or one of"):
        resolve_norm_kernel("fused", "default", cpu)


def test_compile_objective_sets_every_norm():
    args = DrafterArgs(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                       vocab_size=64, target_layer_ids=[1], block_size=4, mask_token_id=63)

    class Objective(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drafter = DFlashDrafter(args)

    obj = Objective()
    compile_objective(obj, "eager", "layers", norm_kernel="triton")
    norms = [m for m in obj.drafter.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 4 + 2 and all(m.one_pass for m in norms)
    compile_objective(obj, "eager", "layers", norm_kernel="autograd")
    assert not any(m.one_pass for m in norms)
