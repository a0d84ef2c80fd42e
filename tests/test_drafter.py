"""Drafter shapes, information flow (no leakage), gradients and argument validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_mp.model import (
    DFlashDrafter,
    DrafterArgs,
    block_labels,
    build_blocks,
    default_target_layer_ids,
    dflash_loss,
    sample_anchors,
    slot_weights,
)

from drafter_utils import tiny_args as shared_tiny_args  # noqa: E402

H, K, V, B = 32, 3, 64, 4
MASK_ID = 63


def tiny_args(**overrides) -> DrafterArgs:
    return shared_tiny_args(**{"vocab_size": V, "block_size": B, **overrides})


MIXED = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)


class Row:
    """One packed row: docs of 10 and 12 tokens, then 4 padding tokens; 4 hand-placed blocks."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.T = 26
        self.doc_ids = torch.tensor([0] * 10 + [1] * 12 + [-1] * 4)
        self.position_ids = torch.tensor(list(range(10)) + list(range(12)) + [0] * 4)
        self.loss_mask = (self.doc_ids >= 0).long()
        self.input_ids = torch.randint(0, MASK_ID, (self.T,), generator=g)
        self.hidden = torch.randn(self.T, K * H, generator=g)
        self.embed = torch.randn(V, H, generator=g)  # the frozen target embedding
        # Block 0 in doc 0 at 6; block 1 at doc 1's start (no context); block 2 in doc 1 at 17;
        # block 3 invalid.
        self.anchors = torch.tensor([6, 10, 17, 0])
        self.valid = torch.tensor([True, True, True, False])

    def run(self, drafter, hidden=None, block_embeds=None):
        block_ids, block_pos = build_blocks(self.input_ids, self.position_ids, self.anchors, B, MASK_ID)
        if block_embeds is None:
            block_embeds = F.embedding(block_ids, self.embed)
        attn = drafter.build_attention(self.anchors, self.valid, self.doc_ids, backend="dense")
        hidden = self.hidden if hidden is None else hidden
        return drafter(hidden, block_embeds, self.position_ids, block_pos, attn).view(-1, B, H)


def make_drafter(**overrides) -> DFlashDrafter:
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_args(**overrides))
    with torch.no_grad():
        # Move the norms off 1.0 so a test would notice a norm that is skipped or misplaced.
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return drafter.eval()


@pytest.mark.parametrize("overrides", [{}, MIXED])
def test_shapes_and_state_dict(overrides):
    drafter = make_drafter(**overrides)
    row = Row()
    out = row.run(drafter)
    assert out.shape == (4, B, H) and torch.isfinite(out).all()
    keys = set(drafter.state_dict())
    assert "rotary_emb.inv_freq" not in keys
    assert not any("embed" in k or "lm_head" in k or k.endswith("bias") for k in keys)


@pytest.mark.parametrize("overrides", [{}, MIXED], ids=["full", "mixed"])
def test_no_leakage_and_real_context_dependence(overrides):
    drafter = make_drafter(**overrides)
    row = Row()
    base = row.run(drafter)
    g = torch.Generator().manual_seed(9)

    def perturbed(positions):
        hidden = row.hidden.clone()
        hidden[positions] += 3 * torch.randn(len(positions), K * H, generator=g)
        return row.run(drafter, hidden=hidden)

    # Block 2 (anchor 17, doc 1 = positions 10..21): its anchor and everything after it, the
    # other document, and the padding are invisible.
    out = perturbed(list(range(17, 26)) + list(range(0, 10)))
    torch.testing.assert_close(out[2], base[2], atol=0, rtol=0)
    # Block 1 sits at its document's start: no context at all.
    out = perturbed(list(range(26)))
    torch.testing.assert_close(out[1], base[1], atol=0, rtol=0)
    torch.testing.assert_close(out[3], base[3], atol=0, rtol=0)  # invalid anchor: no context
    # Block 0 (anchor 6, doc 0) does see position 5, and block 2 sees position 16.
    out = perturbed([5, 16])
    assert (out[0] - base[0]).abs().max() > 1e-3
    assert (out[2] - base[2]).abs().max() > 1e-3
    torch.testing.assert_close(out[1], base[1], atol=0, rtol=0)

    # Other blocks' tokens are invisible; a block's own tokens are not.
    block_ids, _ = build_blocks(row.input_ids, row.position_ids, row.anchors, B, MASK_ID)
    embeds = F.embedding(block_ids, row.embed).view(4, B, H).clone()
    embeds[0] += torch.randn(B, H, generator=g)
    embeds[3] += torch.randn(B, H, generator=g)
    out = row.run(drafter, block_embeds=embeds.view(-1, H))
    for i in (1, 2):
        torch.testing.assert_close(out[i], base[i], atol=0, rtol=0)
    assert (out[0] - base[0]).abs().max() > 1e-3


def test_sliding_window_bounds_context():
    # All layers sliding with window 3: slot k of the block anchored at 17 sees p > 14 + k only.
    drafter = make_drafter(layer_types=["sliding_attention"] * 2, sliding_window=3)
    row = Row()
    base = row.run(drafter)
    hidden = row.hidden.clone()
    hidden[10:15] += 5.0
    out = row.run(drafter, hidden=hidden)
    torch.testing.assert_close(out[2], base[2], atol=0, rtol=0)
    hidden = row.hidden.clone()
    hidden[16] += 5.0
    assert (row.run(drafter, hidden=hidden)[2, 0] - base[2, 0]).abs().max() > 1e-3
    # Causal inside the block: changing the last slot's input leaves earlier slots alone.
    block_ids, _ = build_blocks(row.input_ids, row.position_ids, row.anchors, B, MASK_ID)
    embeds = F.embedding(block_ids, row.embed).view(4, B, H).clone()
    embeds[2, B - 1] += 1.0
    out = row.run(drafter, block_embeds=embeds.view(-1, H))
    torch.testing.assert_close(out[2, : B - 1], base[2, : B - 1], atol=0, rtol=0)


def test_gradients_reach_every_parameter_and_not_the_frozen_target():
    drafter = make_drafter(**MIXED).train()
    row = Row()
    embed = row.embed.clone()  # frozen, as the trainer holds it
    lm_head = torch.randn(V, H, requires_grad=True)  # even a head that asks for grad gets none
    gen = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(row.loss_mask, row.doc_ids, 6, 3, generator=gen)
    block_ids, block_pos = build_blocks(row.input_ids, row.position_ids, anchors, B, MASK_ID)
    attn = drafter.build_attention(anchors, valid, row.doc_ids, backend="dense")
    out = drafter(row.hidden, F.embedding(block_ids, embed), row.position_ids, block_pos, attn)
    labels, mask = block_labels(row.input_ids, row.loss_mask, row.doc_ids, anchors, valid, B)
    loss, _ = dflash_loss(out, lm_head, labels, mask, slot_weights(B, gamma=2.0), chunk_size=5)
    loss.backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert lm_head.grad is None and embed.grad is None


@pytest.mark.parametrize("overrides", [{}, MIXED, {"num_layers": 1}])
def test_training_form_equals_every_row_through_every_layer(overrides):
    """The step's form (the first layer projects the A anchors and the one mask row, the last computes
    slots 1..B-1 only) gives the general form's slots 1..B-1 and the same gradients (fp32)."""
    row = Row()
    gen = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(row.loss_mask, row.doc_ids, 6, 3, generator=gen)
    block_ids, block_pos = build_blocks(row.input_ids, row.position_ids, anchors, B, MASK_ID)
    labels, mask = block_labels(row.input_ids, row.loss_mask, row.doc_ids, anchors, valid, B)
    head = torch.randn(V, H, generator=gen)
    outs, grads = [], []
    for shared in (False, True):
        drafter = make_drafter(**overrides).train()
        attn = drafter.build_attention(anchors, valid, row.doc_ids, backend="dense")
        if shared:
            out = drafter(row.hidden, F.embedding(row.input_ids[anchors], row.embed), row.position_ids, block_pos,
                          attn, mask_embed=row.embed[MASK_ID], predicted_only=True)
            assert out.shape == (anchors.shape[0] * (B - 1), H)
        else:
            out = drafter(row.hidden, F.embedding(block_ids, row.embed), row.position_ids, block_pos, attn)
            assert out.shape == (anchors.shape[0] * B, H)
            out = out.view(-1, B, H)[:, 1:].reshape(-1, H)
        loss, _ = dflash_loss(out, head, labels, mask, slot_weights(B, gamma=2.0), chunk_size=5)
        loss.backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in drafter.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_bf16_forward_and_rope_stays_fp32():
    drafter = make_drafter(**MIXED)
    inv_freq = drafter.rotary_emb.inv_freq.clone()
    drafter = drafter.to(torch.bfloat16)
    assert drafter.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(drafter.rotary_emb.inv_freq, inv_freq)
    row = Row()
    row.hidden, row.embed = row.hidden.bfloat16(), row.embed.bfloat16()
    with torch.no_grad():
        out = row.run(drafter)
        assert out.dtype == torch.bfloat16
        # The same (bf16-valued) weights and inputs computed in fp32: only the arithmetic's rounding
        # differs. Tolerance 0.03 absolute: two bf16 steps (2**-6 = 0.016) at the outputs' largest
        # magnitudes (2-4; std 1.1); measured max error 0.015.
        exact = Row()
        exact.hidden, exact.embed = row.hidden.float(), row.embed.float()
        ref = exact.run(drafter.float())
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)


def test_autocast_bf16_over_fp32_weights():
    """The trainer's CUDA precision mode (bf16 autocast, fp32 masters), here on CPU autocast."""
    drafter = make_drafter(**MIXED).train()
    row = Row()
    row.hidden = row.hidden.bfloat16()
    gen = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(row.loss_mask, row.doc_ids, 6, 3, generator=gen)
    block_ids, block_pos = build_blocks(row.input_ids, row.position_ids, anchors, B, MASK_ID)
    labels, mask = block_labels(row.input_ids, row.loss_mask, row.doc_ids, anchors, valid, B)
    head = torch.randn(V, H).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn = drafter.build_attention(anchors, valid, row.doc_ids, backend="dense")
        embeds = F.embedding(block_ids, row.embed).bfloat16()
        out = drafter(row.hidden, embeds, row.position_ids, block_pos, attn)
        loss, _ = dflash_loss(out, head, labels, mask, slot_weights(B, gamma=2.0), chunk_size=5)
    assert out.dtype == torch.bfloat16 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in drafter.parameters())
    # Close to the fp32 computation.
    with torch.no_grad():
        attn = drafter.build_attention(anchors, valid, row.doc_ids, backend="dense")
        embeds = F.embedding(block_ids, row.embed)
        ref = drafter(row.hidden.float(), embeds, row.position_ids, block_pos, attn)
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)


def test_rope_scaling_uses_transformers_init():
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    drafter = DFlashDrafter(tiny_args(rope_scaling=scaling, max_position_embeddings=4096))
    cfg = Qwen3Config(
        hidden_size=H, num_attention_heads=4, head_dim=8, rope_theta=1e6, rope_scaling=dict(scaling),
        max_position_embeddings=4096,
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, None)
    torch.testing.assert_close(drafter.rotary_emb.inv_freq, inv_freq.float())
    assert drafter.rotary_emb.attention_scaling == pytest.approx(scale)
    assert not torch.allclose(drafter.rotary_emb.inv_freq, DFlashDrafter(tiny_args()).rotary_emb.inv_freq)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(num_layers=0), "num_layers=0"),
        (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
        (dict(layer_types=["full_attention"]), "layer_types"),
        (dict(layer_types=["full_attention", "local"]), "local"),
        (dict(target_layer_ids=[]), "target_layer_ids"),
        (dict(block_size=1), "block_size"),
        (dict(mask_token_id=V), "mask_token_id"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    ],
)
def test_args_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_args(**overrides)


def test_args_properties_and_default_layer_ids():
    args = tiny_args(**MIXED)
    assert args.num_target_layers == 3 and args.has_sliding
    assert tiny_args().resolved_layer_types == ["full_attention"] * 2
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]


def _cuda_row(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 200, (T // 20,), generator=g).tolist()
    doc_ids, pos = [], []
    for d, n in enumerate(lens):
        n = min(n, T - 16 - len(doc_ids))
        if n <= 0:
            break
        doc_ids += [d] * n
        pos += list(range(n))
    pad = T - len(doc_ids)
    doc_ids = torch.tensor(doc_ids + [-1] * pad)
    pos = torch.tensor(pos + [0] * pad)
    loss_mask = ((torch.rand(T, generator=g) > 0.3) & (doc_ids >= 0)).long()
    return doc_ids.cuda(), pos.cuda(), loss_mask.cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex on CUDA needs a GPU")
@pytest.mark.parametrize("backend", ["flex", "triton"])
def test_flex_matches_dense_on_cuda_and_compiled_step_never_recompiles(backend):
    """flex, and the Triton block kernels, against dense sdpa: eager, compiled, compiled under autocast."""
    torch._dynamo.reset()
    T, A, Bk, Hd, Vv = 512, 32, 16, 128, 512
    args = DrafterArgs(
        hidden_size=Hd, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
        vocab_size=Vv, target_layer_ids=[1, 2, 3], mask_token_id=Vv - 1, block_size=Bk,
        layer_types=["sliding_attention", "full_attention"], sliding_window=64,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(args).cuda()
    embed = torch.randn(Vv, Hd, device="cuda")
    lm_head = torch.randn(Vv, Hd, device="cuda") / Hd**0.5
    weights = slot_weights(Bk).cuda()

    def step(hidden, input_ids, pos, doc_ids, loss_mask, anchors, valid, backend):
        block_ids, block_pos = build_blocks(input_ids, pos, anchors, Bk, Vv - 1)
        attn = drafter.build_attention(anchors, valid, doc_ids, backend=backend)
        out = drafter(hidden, F.embedding(block_ids, embed), pos, block_pos, attn)
        labels, mask = block_labels(input_ids, loss_mask, doc_ids, anchors, valid, Bk)
        return dflash_loss(out, lm_head, labels, mask, weights, chunk_size=256)[0]

    def grads(loss):
        drafter.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in drafter.parameters()]

    # One compiled step; the autocast variant is a second cache entry, then neither recompiles.
    compiled = torch.compile(step, dynamic=False)
    for i in range(4):
        doc_ids, pos, loss_mask = _cuda_row(T, i)
        hidden = torch.randn(T, 3 * Hd, device="cuda")
        input_ids = torch.randint(0, Vv - 1, (T,), device="cuda")
        anchors, valid = sample_anchors(loss_mask, doc_ids, A, 4)
        inputs = (hidden, input_ids, pos, doc_ids, loss_mask, anchors, valid)
        dense = step(*inputs, "dense")
        g_dense = grads(dense)
        flex = step(*inputs, backend)  # eager model, compiled flex kernels
        g_flex = grads(flex)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            full = compiled(*inputs, backend)  # the whole step in one graph
        g_full = grads(full)
        # The trainer's mode: bf16 autocast over fp32 weights, whole step compiled.
        with torch._dynamo.config.patch(error_on_recompile=i > 0), torch.autocast("cuda", torch.bfloat16):
            half = compiled(hidden.bfloat16(), *inputs[1:], backend)
        g_half = grads(half)
        torch.testing.assert_close(half, dense, atol=5e-2, rtol=2e-2)
        assert all(torch.isfinite(g).all() for g in g_half)
        torch.testing.assert_close(flex, dense, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(full, dense, atol=2e-4, rtol=2e-4)
        for a, b, c in zip(g_dense, g_flex, g_full):
            torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-3)
            torch.testing.assert_close(c, a, atol=2e-4, rtol=2e-3)


@pytest.mark.parametrize("mode,scope", [("default", "layers"), ("default", "step"), ("eager", "layers")])
def test_the_layers_scope_compiles_each_decoder_layer_and_both_outer_norms(mode, scope):
    """train.compile_scope=layers: one compiled module per decoder layer plus the hidden and final norms
    (trainer.layer_scope_modules, which the bench's modes also recompile); the step scope compiles the
    objective whole and eager nothing, leaving the modules as they are. Compiles are lazy: nothing runs."""
    from dflash_mp.trainer import DFlashObjective, DrafterConfig, compile_objective, layer_scope_modules

    drafter = make_drafter()
    embed, head = torch.randn(V, H), torch.randn(V, H)
    cfg = DrafterConfig(block_size=B, num_anchors=2, max_anchors_per_doc=2, attention="dense", gamma=4.0)
    obj = DFlashObjective(drafter, drafter.args, embed, head, cfg)
    out = compile_objective(obj, mode, scope)
    compiled = {name for name, m in drafter.named_modules() if m._compiled_call_impl is not None}
    if (mode, scope) == ("default", "layers"):
        assert out is obj
        assert compiled == {f"layers.{i}" for i in range(len(drafter.layers))} | {"hidden_norm", "norm"}
        named = {id(drafter.get_submodule(n)) for n in compiled}
        assert {id(m) for m in layer_scope_modules(drafter)} == named
    else:
        assert compiled == set()
        assert (out is obj) == (mode == "eager")
