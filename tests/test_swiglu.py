"""The SwiGLU MLP's gate and up projections in one Triton GEMM (swiglu.py): the kernel against the
model's own MLP in Triton's interpreter (fp32: tails in every dimension, one tile a program and
persistent programs; the form that also writes both projections) and on a GPU (bf16, the real tiles),
and a target's compiled layers through it, captured as a CUDA graph. The training form (`swiglu_mlp`:
that forward, and the backward's GEMM with the SwiGLU's gradient as its epilogue): its gradients
against the model's own MLP's, eager and compiled, in the interpreter and on a GPU, and a drafter's
compiled step through it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

import triton_interp
from dflash_mp import swiglu as swiglu_module
from dflash_mp.swiglu import (TILES, TILES_BWD, fused_runs, gated_silu, swiglu, swiglu_bwd_op,
                              swiglu_bwd_reference, swiglu_gu_op, swiglu_mlp, swiglu_op, swiglu_reference)

CUDA = torch.device("cuda")
# (M, K, N, tiles): M, N and K none a multiple of their tile; a group of tile rows past the last one.
CASES = [(40, 48, 24, (16, 16, 16, 2, 4, 1, False)), (50, 40, 72, (16, 32, 16, 3, 4, 2, True)),
         (64, 64, 64, (32, 32, 32, 8, 4, 2, True))]


def llama(**kw) -> LlamaConfig:
    return LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, **kw)


def test_a_llama_style_mlp_is_recognised_and_nothing_else():
    assert gated_silu(Qwen3MLP(Qwen3Config(hidden_size=16, intermediate_size=32)))
    assert gated_silu(LlamaMLP(llama(mlp_bias=False)))
    assert not gated_silu(LlamaMLP(llama(mlp_bias=True)))
    assert not gated_silu(LlamaMLP(llama(hidden_act="gelu")))
    assert not gated_silu(nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16)))


def test_without_triton_the_reference_runs():
    """On CPU (the CPU build of torch has no Triton) swiglu is the model's own arithmetic, bit for bit."""
    g = torch.Generator().manual_seed(0)
    x, wg, wu = (torch.randn(s, generator=g) for s in ((2, 5, 16), (24, 16), (24, 16)))
    mlp = Qwen3MLP(Qwen3Config(hidden_size=16, intermediate_size=24))
    mlp.gate_proj.weight.data, mlp.up_proj.weight.data = wg, wu
    want = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
    assert not fused_runs(x.bfloat16())
    assert torch.equal(swiglu(x, wg, wu), want)


def test_the_device_check_is_a_constant_to_dynamo(monkeypatch):
    """Where the GEMMs run is asked of the driver, which Dynamo cannot trace (on CUDA: Triton's
    get_device_properties): a layer compiled whole takes the answer as a constant instead of breaking."""
    import os
    import sys

    real = swiglu_module.available

    def untraceable(device):  # what the driver query is to Dynamo: a C function it will not trace
        return sys.getrefcount(device) > 0 and bool(os.getpid()) and real(device)

    monkeypatch.setattr(swiglu_module, "available", untraceable)
    g = torch.Generator().manual_seed(0)
    x, wg, wu, wd = (torch.randn(s, generator=g).bfloat16() for s in ((6, 16), (24, 16), (24, 16), (16, 24)))
    compiled = torch.compile(swiglu_mlp, fullgraph=True, dynamic=False, backend="aot_eager")
    torch.testing.assert_close(compiled(x, wg, wu, wd), plain_mlp(x, wg, wu, wd))


def check_kernel() -> None:
    # Where the fused kernel runs (here: Triton's interpreter): bf16/fp16 rows of 16-byte multiples.
    assert fused_runs(torch.zeros(2, 16, dtype=torch.bfloat16)) and fused_runs(torch.zeros(2, 8, dtype=torch.float16))
    assert not fused_runs(torch.zeros(2, 12, dtype=torch.bfloat16)) and not fused_runs(torch.zeros(2, 16))
    torch.manual_seed(0)
    for M, K, N, tiles in CASES:
        x, wg, wu = torch.randn(M, K), torch.randn(N, K) / 8, torch.randn(N, K) / 8
        got, want = swiglu_op(x, wg, wu, list(tiles)), swiglu_reference(x, wg, wu)
        assert got.shape == (M, N)
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-5, (M, K, N, tiles, err)
        # The training form also writes both projections, from the same accumulators.
        h, g, u = swiglu_gu_op(x, wg, wu, list(tiles))
        assert torch.equal(h, got), (M, K, N, tiles)
        for out, w in ((g, wg), (u, wu)):
            want = x @ w.T
            err = float((out - want).abs().max() / want.abs().max())
            assert err < 1e-5, (M, K, N, tiles, err)


def mlp_grads(fn, x, ws, dy) -> list[torch.Tensor]:
    """[y, dx, dwg, dwu, dwd] of `fn(x, wg, wu, wd)` against the output gradient dy."""
    x, *ws = (t.detach().clone().requires_grad_() for t in (x, *ws))
    y = fn(x, *ws)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in (x, *ws)]


def plain_mlp(x, wg, wu, wd):
    return nn.functional.linear(swiglu_reference(x, wg, wu), wd)


def check_training_form() -> None:
    torch.manual_seed(0)
    for M, K, N, tiles in CASES:
        # The backward GEMM alone: dh = dy wd with the SwiGLU's gradient as its epilogue.
        dy, wd = torch.randn(M, K), torch.randn(K, N) / 8
        g, u = torch.randn(M, N), torch.randn(M, N)
        got, want = swiglu_bwd_op(dy, wd, g, u, list(tiles)), swiglu_bwd_reference(dy, wd, g, u)
        for a, b in zip(got, want):
            assert a.shape == (M, N)
            err = float((a - b).abs().max() / b.abs().max())
            assert err < 1e-5, (M, K, N, tiles, err)
        # The whole MLP, forward and backward, against the model's own ops; eager, then compiled.
        x, wg, wu = torch.randn(M, K), torch.randn(N, K) / 8, torch.randn(N, K) / 8
        ws = (wg, wu, torch.randn(K, N) / 8)

        def fused(x, wg, wu, wd):
            return swiglu_module._TrainedMLP.apply(x, wg, wu, wd, list(tiles), list(tiles))

        want = mlp_grads(plain_mlp, x, ws, dy)
        for fn in (fused, torch.compile(fused, fullgraph=True, dynamic=False)):
            for name, a, b in zip(("y", "dx", "dwg", "dwu", "dwd"), mlp_grads(fn, x, ws, dy), want):
                err = float((a - b).abs().max() / b.abs().max())
                assert err < 1e-5, (name, M, K, N, tiles, err)
    # Where it runs, `swiglu_mlp` goes through the Triton GEMMs (bf16 rows), else the model's own ops.
    x, (wg, wu), wd = torch.randn(4, 16), torch.randn(2, 24, 16), torch.randn(16, 24)
    assert swiglu_mlp(x.bfloat16().requires_grad_(), wg.bfloat16(), wu.bfloat16(),
                      wd.bfloat16()).grad_fn.next_functions[0][0].name().startswith("_TrainedMLP")
    assert swiglu_mlp(x.requires_grad_(), wg, wu, wd).grad_fn.name() == "MmBackward0"  # fp32 rows
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weights under autocast
        assert swiglu_mlp(x.bfloat16(), wg, wu, wd).grad_fn.name() == "MmBackward0"


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
@pytest.mark.parametrize("check", ["check_kernel", "check_training_form", "check_drafter"])
def test_the_kernels_in_the_triton_interpreter(check):
    """check_kernel: the forward kernel equals the MLP's SwiGLU; check_training_form: the backward GEMM
    and the training MLP's gradients, eager and compiled; check_drafter: a drafter through it."""
    run = triton_interp.run("test_swiglu", f"{check}()")
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_is_within_bf16_rounding_of_the_mlp_on_cuda():
    """bf16 at the default tiles, M and N not tile multiples: no farther from the product in fp32 than
    the model's own MLP (which rounds the projections to bf16 before the SwiGLU)."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    M, K, N = 1000, 512, 1000
    x = torch.randn(M, K, device=CUDA, generator=g).to(torch.bfloat16)
    wg, wu = ((torch.randn(N, K, device=CUDA, generator=g) / K ** 0.5).to(torch.bfloat16) for _ in range(2))
    exact = nn.functional.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)
    scale = exact.abs().max()
    got = float((swiglu(x, wg, wu, TILES).float() - exact).abs().max() / scale)
    ref = float((swiglu_reference(x, wg, wu).float() - exact).abs().max() / scale)
    assert got <= ref + 1e-3 and got < 1e-2, (got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_target_compiled_through_the_kernel_captures_what_its_own_layers_do_and_replays():
    """A tiny Qwen3 (bf16, head_dim 128) compiled with the fused SwiGLU: its layers load-check against the
    model's own (check_compiled), the captures stay within bf16 rounding of the unfused worker's, and
    the forward replays as one CUDA graph."""
    from test_target import packed
    from test_target_varlen import tiny_qwen3
    from dflash_mp.target import TargetWorker

    model = tiny_qwen3(CUDA, torch.bfloat16, 300, head_dim=128)
    model.config._attn_implementation = "triton"
    rows = [packed([300, 520, 130], 1024, 96), packed([100, 400, 60, 250, 200], 1024, 96, seed=1)]
    want = [TargetWorker(model, [1, 2, 3], CUDA, compile=True).forward(pb).hidden.clone() for pb in rows]
    worker = TargetWorker(model, [1, 2, 3], CUDA, compile=True, cuda_graph=True, fused_swiglu=True)
    assert worker.deferred and all(c._orig_mod.fused_swiglu for c in worker._calls[1:4])
    assert worker.check_compiled(512) < 0.1
    got = [worker.forward(pb).hidden.clone() for pb in rows]
    assert worker.graph.failed is None and worker.graph.replays == 1
    for g, w, pb in zip(got, want, rows):
        n = pb.num_valid_tokens
        rel = float(((g[:n] - w[:n]).float().norm(dim=-1) / w[:n].float().norm(dim=-1)).max())
        assert rel < 2e-2, rel


def check_drafter() -> None:
    """A tiny drafter (fp16) through the fused MLPs, eager and compiled, against its own modules: the
    loss and every parameter's gradient."""
    import torch.nn.functional as F

    from dflash_mp.model import (DFlashDrafter, block_labels, build_blocks, dflash_loss, sample_anchors,
                                 slot_weights)
    from drafter_utils import tiny_args

    T, A, B, V, H = 96, 8, 8, 64, 32
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_args(vocab_size=V, block_size=B)).half()
    embed, head = torch.randn(V, H).half(), (torch.randn(V, H) / H ** 0.5).half()
    doc_ids = torch.cat([torch.zeros(50), torch.ones(46)]).long()
    pos = torch.cat([torch.arange(50), torch.arange(46)])
    loss_mask, hidden = torch.ones(T, dtype=torch.long), torch.randn(T, 3 * H).half()
    input_ids = torch.randint(0, V - 1, (T,))
    anchors, valid = sample_anchors(loss_mask, doc_ids, A, 4)

    def step():
        block_ids, block_pos = build_blocks(input_ids, pos, anchors, B, V - 1)
        attn = drafter.build_attention(anchors, valid, doc_ids, backend="dense")
        out = drafter(hidden, F.embedding(block_ids, embed), pos, block_pos, attn)
        labels, mask = block_labels(input_ids, loss_mask, doc_ids, anchors, valid, B)
        loss = dflash_loss(out, head, labels, mask, slot_weights(B), chunk_size=64)[0]
        drafter.zero_grad(set_to_none=True)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in drafter.parameters()]

    want = step()
    for layer in drafter.layers:
        layer.mlp.fused = swiglu_mlp
    y = drafter.layers[0].mlp(torch.randn(5, H).half())  # the MLPs go through it
    assert y.grad_fn.next_functions[0][0].name().startswith("_TrainedMLP"), y.grad_fn
    names = ["loss"] + [n for n, _ in drafter.named_parameters()]
    for how, got, tol in (("eager", step(), 1e-2), ("compiled", torch.compile(step, dynamic=False)(), 2e-2)):
        for name, a, b in zip(names, got, want, strict=True):
            err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
            assert err < tol, (how, name, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_training_form_is_within_bf16_rounding_of_the_mlp_on_cuda_eager_and_compiled():
    """bf16 at the default tiles (TILES, TILES_BWD), M and N not tile multiples: the output and every
    gradient no farther from the fp32 MLP's than the model's own bf16 MLP's are, eager and compiled."""
    assert fused_runs(torch.zeros(2, 8, dtype=torch.bfloat16, device=CUDA))
    g = torch.Generator(device=CUDA).manual_seed(0)
    M, K, N = 1000, 512, 1000
    x, dy = (torch.randn(M, K, device=CUDA, generator=g) for _ in range(2))
    ws = [torch.randn(N, K, device=CUDA, generator=g) / K ** 0.5 for _ in range(2)]
    ws.append(torch.randn(K, N, device=CUDA, generator=g) / N ** 0.5)
    exact = mlp_grads(plain_mlp, x, ws, dy)
    half = [x.bfloat16(), [w.bfloat16() for w in ws], dy.bfloat16()]
    ref = mlp_grads(plain_mlp, half[0], half[1], half[2])

    def fused(x, wg, wu, wd):
        return swiglu_mlp(x, wg, wu, wd, TILES, TILES_BWD)

    for fn in (fused, torch.compile(fused, fullgraph=True, dynamic=False)):
        got = mlp_grads(fn, half[0], half[1], half[2])
        for name, a, r, e in zip(("y", "dx", "dwg", "dwu", "dwd"), got, ref, exact):
            scale = e.abs().max()
            err, ref_err = (float((t.float() - e).abs().max() / scale) for t in (a, r))
            assert err <= 1.5 * ref_err + 1e-3 and err < 2e-2, (name, err, ref_err)
