import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_mp.batch import PackedBatch, join_rows
from dflash_mp.target import (
    FLEX_OUTSIDE_GRAPH,
    TargetWorker,
    block_diagonal_causal_mask,
    default_layer_ids,
    truncate,
)


def tiny_model(tmp_path, layers=6, window=None):
    """`window`: layers 2.. are sliding-window layers of that width (transformers' own masks)."""
    sliding = dict(use_sliding_window=True, max_window_layers=2, sliding_window=window) if window else {}
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      **sliding)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="sdpa").eval()


def packed(doc_lens, seq_len, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(doc_lens)
    ids = torch.zeros(seq_len, dtype=torch.long)
    ids[:n] = torch.randint(0, vocab, (n,), generator=g)
    pos = torch.zeros(seq_len, dtype=torch.long)
    docs = torch.full((seq_len,), -1, dtype=torch.long)
    o = 0
    for i, L in enumerate(doc_lens):
        pos[o:o + L] = torch.arange(L)
        docs[o:o + L] = i
        o += L
    return PackedBatch(ids, pos, docs, (docs >= 0).long(), len(doc_lens), n)


def test_default_layer_ids_match_qwen3_8b():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    with pytest.raises(ValueError, match="num_capture=9"):
        default_layer_ids(6, 9)


@pytest.mark.parametrize("attn,window", [("sdpa", None), ("sdpa", 4), ("flex_attention", 4)])
def test_packed_forward_equals_per_document_forward(tmp_path, attn, window):
    """Packed rows of several documents give each document what it gets alone, sliding-window
    layers (window 4 < the documents' lengths) included."""
    model = tiny_model(tmp_path, window=window)
    model.config._attn_implementation = attn
    full = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    layer_ids = [1, 2, 3]
    truncate(model, max(layer_ids))
    worker = TargetWorker(model, layer_ids, torch.device("cpu"))
    assert worker.window == window
    pb = packed([7, 12, 5], 32)
    hb = worker.forward(pb)
    assert hb.hidden.shape == (32, 3 * 32)
    o = 0
    for L in [7, 12, 5]:
        with torch.no_grad():
            ref = full(input_ids=pb.input_ids[None, o:o + L], output_hidden_states=True).hidden_states
        want = torch.cat([ref[i + 1][0] for i in layer_ids], dim=-1)  # layer i = hidden_states[i + 1]
        torch.testing.assert_close(hb.hidden[o:o + L], want, rtol=1e-4, atol=1e-5)
        o += L


def test_compiled_target_runs_flex_outside_the_graph_and_matches_eager(tmp_path):
    """Compiled, flex_attention stays its own kernel (a graph break), and the captured states are unchanged."""
    from torch._dynamo.utils import counters

    model = tiny_model(tmp_path)
    model.config._attn_implementation = "flex_attention"
    layer_ids = [1, 2, 3]
    truncate(model, max(layer_ids))
    pb = packed([7, 12, 5], 32)
    want = TargetWorker(model, layer_ids, torch.device("cpu")).forward(pb).hidden
    breaks = sum(counters["graph_break"].values())
    worker = TargetWorker(model, layer_ids, torch.device("cpu"), compile=True)
    assert model.config._attn_implementation == FLEX_OUTSIDE_GRAPH
    got = worker.forward(pb).hidden
    assert sum(counters["graph_break"].values()) > breaks
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layers", [None, (0, 3), (3, 6)])
def test_compiled_layers_hand_on_their_residual_and_capture_what_eager_does(tmp_path, layers):
    """Compiled layer by layer, Llama-laid-out layers hand the next one (residual, delta) (DeferredAdd):
    the captured layers (the first, middle ones, the model's last after its final norm) and, on a
    stage before the last, the residual stream it passes on, equal the eager forward's; on a later
    stage the previous stages' columns pass through."""
    model = tiny_model(tmp_path)
    truncate(model, 5)
    cpu = torch.device("cpu")
    worker = TargetWorker(model, [0, 2, 3, 5], cpu, compile=True, layers=layers)
    assert worker.deferred and not TargetWorker(model, [0, 2, 3, 5], cpu, compile=True, layers=layers,
                                                defer_residual=False).deferred
    pb = packed([7, 12, 5], 32)
    docs = pb.doc_ids
    if worker.first_stage:
        x, before = pb.input_ids, None
    else:
        x, before = torch.randn(32, 32), torch.randn(32, 64)
    got = worker._forward(x, pb.position_ids, worker.masks(docs), before)
    want = worker._forward(x, pb.position_ids, worker.masks(docs), before, eager=True)
    assert got.shape == want.shape == (32, 32 * (len(worker.layer_ids) + (not worker.last_stage)) + (0 if before is None
                                                                                                  else 64))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_layer_whose_arithmetic_differs_is_compiled_as_it_is(tmp_path, caplog):
    """A layer with Llama's submodules but another residual (here scaled by 0.5) is not run as a
    DeferredAdd: the load check finds its eager DeferredAdd differs, warns, and compiles the layers as
    they are; the compiled features still equal the eager ones."""
    import logging
    import types

    model = tiny_model(tmp_path)
    truncate(model, 3)

    def scaled(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        a = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                           position_ids=position_ids, position_embeddings=position_embeddings)[0]
        h = 0.5 * hidden_states + a
        return h + self.mlp(self.post_attention_layernorm(h))

    for layer in model.get_decoder().layers:
        layer.forward = types.MethodType(scaled, layer)
    worker = TargetWorker(model, [1, 3], torch.device("cpu"), compile=True)
    assert worker.deferred
    with caplog.at_level(logging.WARNING, logger="dflash_mp.target"):
        assert worker.check_compiled(64) < 1e-5
    assert "layer 0 run with its residual add deferred to the next layer differs" in caplog.text
    assert worker.compiled and not worker.deferred
    pb = packed([10, 6], 20)
    torch.testing.assert_close(worker.forward(pb).hidden, TargetWorker(model, [1, 3], torch.device("cpu"))
                               .forward(pb).hidden, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scope", ["layers", "forward"])
def test_the_target_compiles_with_untimed_pointwise_configs(tmp_path, monkeypatch, scope):
    """Every torch.compile of the target takes COMPILE_OPTIONS, which keep Inductor from timing its
    pointwise configs (the timed pick of the 8B SwiGLU's config flipped between runs, 1.80 against
    2.79 ms a forward on the GPU)."""
    from dflash_mp.target import worker as worker_module

    seen = []

    def spy(fn, **kwargs):
        seen.append(kwargs.get("options"))
        return fn

    monkeypatch.setattr(worker_module.torch, "compile", spy)
    model = tiny_model(tmp_path)
    truncate(model, 3)
    TargetWorker(model, [1, 3], torch.device("cpu"), compile=True, compile_scope=scope)
    assert len(seen) == (4 if scope == "layers" else 1)
    assert all(o == {"triton.autotune_pointwise": False} for o in seen)
    # Options a caller adds (bench/target_forward.py's -autotune variants) come on top of those.
    seen.clear()
    TargetWorker(model, [1, 3], torch.device("cpu"), compile=True, compile_scope=scope,
                 compile_options={"max_autotune": True})
    assert len(seen) == (4 if scope == "layers" else 1)
    assert all(o == {"triton.autotune_pointwise": False, "max_autotune": True} for o in seen)


def test_later_layers_and_lm_head_never_run(tmp_path):
    model = tiny_model(tmp_path)
    calls = []
    dec = model.get_decoder()
    for i, layer in enumerate(dec.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
    model.lm_head.register_forward_hook(lambda m, a, o: calls.append("lm_head"))
    dec.norm.register_forward_hook(lambda m, a, o: calls.append("norm"))
    truncate(model, 2)
    TargetWorker(model, [0, 2], torch.device("cpu")).forward(packed([10, 6], 20))
    assert calls == [0, 1, 2]
    assert len(model.get_decoder().layers) == 3


def test_block_diagonal_mask():
    m = block_diagonal_causal_mask(torch.tensor([0, 0, 1, 1, -1]))[0, 0]
    assert m.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]


def test_attention_is_chosen_per_architecture(monkeypatch):
    """auto without Triton (with it: test_doc_attn): flex_attention on CUDA where transformers supports
    it for the model class, sdpa (exact dense document mask) where it does not (Qwen3.5) and on CPU;
    flex_attention asked for on a class without transformers' support loads with sdpa and runs the
    registered function; a bad name is refused with the choices."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    from dflash_mp.target.attention import choose_attention, load_attention

    monkeypatch.setattr("dflash_mp.target.attention.triton_available", lambda device: False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_attention("auto", cuda, Qwen3ForCausalLM) == "flex_attention"
    assert choose_attention("auto", cuda, Qwen3MoeForCausalLM) == "flex_attention"
    assert choose_attention("auto", cuda, Qwen3_5ForCausalLM) == "sdpa"
    assert choose_attention("auto", cpu, Qwen3ForCausalLM) == "sdpa"
    assert choose_attention("flex_attention", cuda, Qwen3_5ForCausalLM) == "flex_attention"
    assert load_attention("flex_attention", Qwen3_5ForCausalLM) == "sdpa"
    assert load_attention("flex_attention", Qwen3ForCausalLM) == "flex_attention"
    with pytest.raises(ValueError, match=r"target.attn_implementation='flash': use auto or one of triton, sdpa"):
        choose_attention("flash", cuda, Qwen3ForCausalLM)


def test_flex_attention_asked_for_on_qwen3_5_loads_through_the_registered_function(tmp_path):
    """Qwen3.5, which transformers will not load with flex_attention, gets it when asked: loaded
    with sdpa, then switched to the registered function that takes the packed block mask (its
    captures equal sdpa's: tests/test_hybrid_gpu.py, on the GPU)."""
    from dflash_mp.builtin import resolve_target_path

    path = resolve_target_path("builtin:random-tiny-qwen3.5", str(tmp_path / "cache"))
    flex = TargetWorker.load(path, [1, 3], torch.device("cpu"), torch.float32, "flex_attention", packing_check=False)
    assert flex.model.config._attn_implementation == FLEX_OUTSIDE_GRAPH and flex.flex
    assert "flash" not in FLEX_OUTSIDE_GRAPH  # transformers reads any "...flash..." name as flash attention
    assert flex.attention == f"flex_attention (registered as {FLEX_OUTSIDE_GRAPH})"


def test_a_compiled_forward_that_differs_from_eager_falls_back_to_eager(tmp_path, caplog):
    """At load a compiled target is checked against its eager forward on a packed row: a compiled
    forward equal to rounding stays; one whose features are off (as a MoE hybrid's measured on the
    GPU) is replaced by the eager forward, warned, and the worker says it is not compiled. Here the
    whole-forward compile (compile_scope="forward"); the layer-by-layer one in test_hybrid_targets."""
    import logging

    model = tiny_model(tmp_path)
    truncate(model, 3)
    worker = TargetWorker(model, [1, 3], torch.device("cpu"), compile=True, compile_scope="forward")
    assert worker.check_compiled(64) < 1e-5 and worker.compiled
    compiled = worker._run
    worker._run = lambda *a, **k: compiled(*a, **k) * 1.5  # a compile that gets the features wrong
    with caplog.at_level(logging.WARNING, logger="dflash_mp.target"):
        assert worker.check_compiled(64) > 0.3
    assert not worker.compiled and worker._run == worker._forward
    assert "the compiled forward's features differ from the eager ones" in caplog.text
    torch.testing.assert_close(worker.forward(packed([10, 6], 20)).hidden,
                               TargetWorker(model, [1, 3], torch.device("cpu")).forward(packed([10, 6], 20)).hidden)


@pytest.mark.parametrize("window", [None, 4])  # the Triton kernel's: test_doc_attn.check_worker
def test_rows_in_one_forward_capture_what_each_row_captures_alone(tmp_path, window):
    """target.rows_per_forward: rows laid end to end keep their documents and their padding apart. The
    middle row is one document with no padding, as the next row's first document has id 0 too: joined
    without new ids the two would run as one document."""
    model = tiny_model(tmp_path, window=window)
    truncate(model, 3)
    worker = TargetWorker(model, [1, 2, 3], torch.device("cpu"))
    rows = [packed([7, 12, 5], 32, seed=1), packed([32], 32, seed=2), packed([9, 4], 32, seed=3)]
    joined = join_rows(rows)
    # row 1: documents 0-2, padding 3; row 2: document 4 (no padding: 5 unused); row 3: 6-7, padding 8
    want = [0] * 7 + [1] * 12 + [2] * 5 + [3] * 8 + [4] * 32 + [6] * 9 + [7] * 4 + [8] * 19
    assert joined.doc_ids.tolist() == want
    assert joined.num_valid_tokens == 24 + 32 + 13 and joined.num_docs == 6
    together = worker.forward_rows(rows)
    assert len(together) == 3
    for row, got in zip(rows, together):
        alone = worker.forward(row)
        assert got.hidden.shape == alone.hidden.shape == (32, 3 * 32)
        torch.testing.assert_close(got.hidden, alone.hidden, atol=1e-5, rtol=1e-5)  # padding rows too
        for f in ("input_ids", "position_ids", "doc_ids", "loss_mask"):
            assert torch.equal(getattr(got, f), getattr(row, f)), f
        assert got.num_valid_tokens == row.num_valid_tokens


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_lm_head_is_loaded_once(tmp_path, tied):
    """A drafter rank reads the target's embedding and LM head; where the checkpoint ties them it holds
    one tensor for both (on an 8B-class vocabulary, ~1.2 GB not copied twice), converted to the dtype
    asked for; an untied head is its own tensor."""
    from dflash_mp.target import load_target_head

    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    lm.save_pretrained(tmp_path)
    embed, head = load_target_head(str(tmp_path), torch.float32, torch.device("cpu"))
    assert embed.dtype == head.dtype == torch.float32
    assert torch.equal(embed, lm.get_input_embeddings().weight.float())
    assert torch.equal(head, lm.get_output_embeddings().weight.float())
    assert (embed.data_ptr() == head.data_ptr()) == tied


def _random_norm_weights(model, seed=1):
    """Norm weights away from HF's ones, so a fold that drops or misplaces them shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.get_decoder().layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(torch.empty(norm.weight.shape).uniform_(0.25, 3.0, generator=g))


def test_folded_norms_capture_what_the_layers_own_forwards_do(tmp_path, caplog):
    """`fold_norms`: the load check folds each compiled layer's two RMSNorms into q/k/v and gate/up
    (the norms become Identities) and the captured states equal the unfolded eager forward's to fp32
    rounding; in bf16 the folded states are as far from the fp32 ones as the unfolded states are."""
    import logging

    from dflash_mp.target.fold import NormedLinear

    model = tiny_model(tmp_path)
    _random_norm_weights(model)
    truncate(model, 3)
    cpu = torch.device("cpu")
    pb = packed([10, 14, 8], 40)
    want = TargetWorker(model, [1, 3], cpu).forward(pb).hidden
    worker = TargetWorker(model, [1, 3], cpu, compile=True, fold_norms=True)
    with caplog.at_level(logging.INFO, logger="dflash_mp.target"):
        worker.check_compiled(64)
    assert worker.folded == [0, 1, 2, 3] and 0 < worker.fold_diff < 1e-5
    assert "the norms of 4 layers (0-3) folded into their projections" in caplog.text
    layer = model.get_decoder().layers[2]
    assert isinstance(layer.input_layernorm, torch.nn.Identity)
    assert isinstance(layer.mlp.up_proj, NormedLinear)
    torch.testing.assert_close(worker.forward(pb).hidden, want, rtol=1e-5, atol=1e-5)

    exact = TargetWorker(tiny_model(tmp_path / "b"), [1, 3], cpu)  # the same weights, unfolded, in fp32
    _random_norm_weights(exact.model)
    truncate(exact.model, 3)
    truth = exact.forward(pb).hidden
    exact.model.to(torch.bfloat16)
    plain = TargetWorker(exact.model, [1, 3], cpu).forward(pb).hidden
    TargetWorker(exact.model, [1, 3], cpu).fold_layers()
    folded = TargetWorker(exact.model, [1, 3], cpu).forward(pb).hidden
    err = [float((x.float() - truth).norm() / truth.norm()) for x in (plain, folded)]
    assert 0 < err[1] < 1.25 * err[0] and not torch.equal(plain, folded), err


def test_norms_are_folded_only_where_the_arithmetic_allows(tmp_path, caplog):
    """A norm of another form (here Gemma's `(1 + w) * x / rms`) is not folded; a layer whose attention
    also reads its normed input another way (here added to its output) fails the load check, warned,
    and stays as it was; `fold_layers` is undone bit for bit."""
    import logging
    import types

    model = tiny_model(tmp_path)
    _random_norm_weights(model)
    truncate(model, 3)
    layers = model.get_decoder().layers

    def gemma(self, x):
        x32 = x.float()
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return ((1 + self.weight.float()) * x32 * r).to(x.dtype)

    layers[0].post_attention_layernorm.forward = types.MethodType(gemma, layers[0].post_attention_layernorm)
    attn_forward = layers[1].self_attn.forward

    def leaky(self, hidden_states, **kwargs):
        out, w = attn_forward(hidden_states=hidden_states, **kwargs)
        return out + hidden_states, w

    layers[1].self_attn.forward = types.MethodType(leaky, layers[1].self_attn)
    cpu = torch.device("cpu")
    pb = packed([12, 9], 24)
    want = TargetWorker(model, [1, 3], cpu).forward(pb).hidden
    worker = TargetWorker(model, [1, 3], cpu, compile=True, fold_norms=True)
    with caplog.at_level(logging.WARNING, logger="dflash_mp.target"):
        worker.check_compiled(64)
    assert worker.folded == [0, 2, 3]
    assert "layer 1 with its norms folded into its projections differs from its own forward" in caplog.text
    assert type(layers[0].post_attention_layernorm) is not torch.nn.Identity  # Gemma's: kept
    assert isinstance(layers[0].input_layernorm, torch.nn.Identity)
    assert type(layers[1].self_attn.q_proj) is torch.nn.Linear  # undone
    torch.testing.assert_close(worker.forward(pb).hidden, want, rtol=1e-5, atol=1e-5)

    plain = tiny_model(tmp_path / "c")
    _random_norm_weights(plain)
    truncate(plain, 3)
    eager = TargetWorker(plain, [1, 3], cpu)
    before = eager.forward(pb).hidden
    folds = eager.fold_layers()
    assert len(folds) == 4 and not torch.equal(eager.forward(pb).hidden, before)
    for f in folds:
        f.undo()
    assert torch.equal(eager.forward(pb).hidden, before)
