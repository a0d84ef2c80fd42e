"""Targets beyond dense attention: Qwen3.5 hybrids (Gated DeltaNet linear attention), MoE targets, the
packing self-check every target passes at load, and lossless decoding with recurrent state."""

import logging

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash_mp import speculative
from dflash_mp.batch import PackedBatch
from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.speculative import Drafter, check_lossless, greedy_generate, speculative_generate
from dflash_mp.target import TargetWorker, linear_attn, load_target_config, load_target_head
from dflash_mp.archs import HF_ARCHS, TINY_ARCHS, hf_config

V = 128
ARCHS = ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-moe"]


def save_target(path, arch: str, seed: int = 0) -> str:
    """A checkpoint laid out as the hub's: Qwen3.5 models as the multimodal model (decoder config
    under `text_config`, weights under model.language_model.*, a tiny vision tower), others plain."""
    text = hf_config(TINY_ARCHS[arch], vocab_size=V)
    torch.manual_seed(seed)
    if arch.startswith("tiny-qwen3.5"):
        outer = "qwen3_5_moe" if "moe" in arch else "qwen3_5"
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=text.hidden_size)
        config = AutoConfig.for_model(outer, text_config=text.to_dict(), vision_config=vision)
        model = AutoModelForImageTextToText.from_config(config)
        assert any(k.startswith("model.language_model.layers.") for k in model.state_dict())
    else:
        model = AutoModelForCausalLM.from_config(text)
    model.save_pretrained(path)
    return str(path)


def packed(doc_lens, seq_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(seq_len, dtype=torch.long)
    pos = torch.zeros(seq_len, dtype=torch.long)
    docs = torch.full((seq_len,), -1, dtype=torch.long)
    o = 0
    for i, n in enumerate(doc_lens):
        ids[o:o + n] = torch.randint(0, V, (n,), generator=g)
        pos[o:o + n] = torch.arange(n)
        docs[o:o + n] = i
        o += n
    return PackedBatch(ids, pos, docs, (docs >= 0).long(), len(doc_lens), o)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_rows_capture_what_serving_reads_per_document(tmp_path, arch):
    """Items 1, 2, 5: the nested config loads flat, the embedding comes from model.language_model,
    and packed rows (documents longer than a 64-token Gated DeltaNet chunk, padding after them) give
    every document exactly the `hidden_states[i + 1]` a plain HF forward of that document alone
    gives, the last layer (after the final norm, as serving reads it) included."""
    path = save_target(tmp_path, arch)
    cfg = load_target_config(path)
    assert cfg["num_hidden_layers"] == 4 and cfg["vocab_size"] == V and cfg["hidden_size"] == 64
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    embed, head = load_target_head(path, torch.float32, torch.device("cpu"))
    assert torch.equal(embed, reference.get_input_embeddings().weight)
    assert torch.equal(head, reference.get_output_embeddings().weight)

    layer_ids = [0, 2, 3]
    worker = TargetWorker.load(path, layer_ids, torch.device("cpu"), torch.float32, "sdpa")
    assert type(worker.model).__name__ == type(reference).__name__
    assert bool(worker.linear) == arch.startswith("tiny-qwen3.5")
    lens = [70, 9, 33]
    hb = worker.forward(packed(lens, 128))
    o = 0
    with torch.no_grad():
        for n in lens:
            ids = hb.input_ids[o:o + n][None]
            out = reference(input_ids=ids, output_hidden_states=True)
            want = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
            torch.testing.assert_close(hb.hidden[o:o + n], want, atol=2e-5, rtol=1e-4)
            o += n


def test_real_sizes_build_as_their_architectures():
    """The real-size configs are the architectures they name (no weights drawn: meta device)."""
    for hub_id, fields in HF_ARCHS.items():
        config = hf_config(fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        n = sum(p.numel() for p in model.parameters()) / 1e9
        expected = {"Qwen/Qwen3.5-27B": 27, "Qwen/Qwen3.5-35B-A3B": 35, "Qwen/Qwen3-30B-A3B": 30}[hub_id]
        assert abs(n - expected) / expected < 0.08, (hub_id, n)
    assert HF_ARCHS["Qwen/Qwen3.5-27B"]["layer_types"].count("linear_attention") == 48


def _leaky_attention(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def one_sequence(monkeypatch):
    """Linear-attention layers lose the row's document boundaries: the row runs as one sequence."""
    monkeypatch.setattr(linear_attn.Spans, "of", classmethod(
        lambda cls, docs, device: cls(torch.tensor([0, docs.shape[0]]), device)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_check_refuses_a_target_whose_attention_ignores_the_mask(tmp_path, dtype):
    """Attention that ignores the packed-document mask (plain causal over the whole row) is refused
    by name and layer, in fp32 and in bf16; the same model with the mask honoured passes."""
    path = save_target(tmp_path, "tiny-qwen3-moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    AttentionInterface.register("dflash_mp_test_leaky", _leaky_attention)
    model.config._attn_implementation = "dflash_mp_test_leaky"
    worker = TargetWorker(model, [0, 1], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"target Qwen3MoeForCausalLM: layer 0 \(full_attention\) lets packed "
                                         r"documents see each other: .*packing_check=false"):
        worker.check_packing()
    model.config._attn_implementation = "sdpa"
    assert max(worker.check_packing().values()) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_check_refuses_linear_attention_fed_across_documents(tmp_path, caplog, monkeypatch, dtype):
    """Without the row's document boundaries, Qwen3.5's linear-attention layers carry state from one
    packed document into the next: the load-time check refuses it at the first such layer, in fp32
    and in bf16; packing_check=false skips it, logged."""
    path = save_target(tmp_path, "tiny-qwen3.5")
    one_sequence(monkeypatch)
    with pytest.raises(ValueError, match=r"target Qwen3_5ForCausalLM: layer 0 \(linear_attention\) lets packed"):
        TargetWorker.load(path, [0, 3], torch.device("cpu"), dtype, "sdpa")
    with caplog.at_level(logging.WARNING, logger="dflash_mp.target"):
        TargetWorker.load(path, [0, 3], torch.device("cpu"), dtype, "sdpa", packing_check=False)
    assert "target.packing_check=false: Qwen3_5ForCausalLM is not checked" in caplog.text


@pytest.mark.parametrize("arch", ARCHS)
def test_packing_check_passes_the_hybrid_and_moe_targets_in_bf16(tmp_path, arch):
    """Every layer of the tiny Qwen3.5, Qwen3.5-MoE and Qwen3-MoE, run in bf16, keeps a document's
    outputs within the bf16 tolerances when the other documents change and when it runs alone."""
    path = save_target(tmp_path, arch)
    worker = TargetWorker.load(path, [0, 3], torch.device("cpu"), torch.bfloat16, "sdpa")
    diffs = worker.check_packing()
    assert sorted(diffs) == [0, 1, 2, 3] and max(diffs.values()) < 2e-2


def test_varlen_linear_attention_equals_each_layer_run_per_document(tmp_path):
    """The one-call varlen forward of a Gated DeltaNet layer (its projections, causal conv, gated
    delta rule and gated norm, with the CPU kernels) gives each document of a packed row what the
    layer's own forward gives it alone; without the row's boundaries it would not."""
    path = save_target(tmp_path, "tiny-qwen3.5-moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    module = model.get_decoder().layers[0].linear_attn
    assert linear_attn.supports_varlen(module) and module.num_v_heads > module.num_k_heads  # grouped values
    torch.manual_seed(0)
    lens = [70, 9, 49]
    h = torch.randn(1, sum(lens), 64)
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)])
    with torch.no_grad():
        with linear_attn.documents(linear_attn.Spans.of(docs, torch.device("cpu"))):
            got = linear_attn.varlen_forward(module, h)
        want = torch.cat([module(h[:, s:s + n]) for s, n in zip([0, 70, 79], lens)], dim=1)
        with linear_attn.documents(linear_attn.Spans(torch.tensor([0, sum(lens)]), torch.device("cpu"))):
            crossed = linear_attn.varlen_forward(module, h)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert (crossed[:, 70:] - want[:, 70:]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def hybrid_target(tmp_path_factory):
    path = save_target(tmp_path_factory.mktemp("qwen35"), "tiny-qwen3.5", seed=3)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _drafter(target, block_size):
    args = DrafterArgs(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=V, target_layer_ids=[0, 2], mask_token_id=V - 1, block_size=block_size,
                       rope_theta=10000.0)
    torch.manual_seed(1)
    return Drafter.for_target(DFlashDrafter(args), args, target)


def test_speculative_decoding_on_a_hybrid_target_equals_greedy(hybrid_target, monkeypatch):
    """Item 4: proposals that are greedy's own continuation with one wrong token at a varying place
    reject at every block offset (and sometimes none): the recurrent state must be rolled back
    exactly each time for the output to stay greedy's, token for token."""
    b, n = 4, 24
    drafter = _drafter(hybrid_target, b)
    prompt = [5, 17, 99, 3, 42, 8, 61]
    greedy = greedy_generate(hybrid_target, prompt, n)
    want = greedy.tokens
    step = {"i": 0}

    def oracle(_drafter, context, _anchor, block_size):
        done = context.shape[0] - len(prompt) + 1  # tokens already generated
        proposal = torch.tensor((want + [0] * block_size)[done:done + block_size - 1])
        wrong = step["i"] % block_size  # block_size - 1: no wrong token, the whole block is accepted
        if wrong < block_size - 1:
            proposal[wrong] = (proposal[wrong] + 1) % V
        step["i"] += 1
        return proposal

    monkeypatch.setattr(speculative, "draft_block", oracle)
    spec = speculative_generate(hybrid_target, drafter, prompt, n)
    check_lossless(0, spec, greedy)
    assert set(spec.acceptance_lengths[:-1]) == {1, 2, 3, 4}
    assert spec.num_rollback_forwards == sum(1 for k in spec.acceptance_lengths[:-1] if k < b)
    monkeypatch.undo()
    # A random drafter (rejections almost everywhere) through the real draft path.
    random_spec = speculative_generate(hybrid_target, drafter, prompt, n)
    check_lossless(1, random_spec, greedy)


def test_random_builtins_are_the_real_architectures(tmp_path):
    """builtin:random-qwen3.5-27b is the Qwen3.5-27B decoder at real sizes (config only: weights are
    drawn at load), validates with the qwen3_5_27b preset, and its tiny stand-in loads, passes the
    packing check and shares its embedding with drafter ranks."""
    from dflash_mp.config import compose
    from dflash_mp.builtin import resolve_target_path
    from dflash_mp.runtime import validate

    cache = str(tmp_path)
    cfg = load_target_config(resolve_target_path("builtin:random-qwen3.5-27b", cache))
    assert cfg["model_type"] == "qwen3_5_text" and cfg["hidden_size"] == 5120 and cfg["vocab_size"] == 248320
    assert cfg["layer_types"].count("linear_attention") == 48 and cfg["num_hidden_layers"] == 64
    job = compose(["experiment=qwen3_5_27b", "target.path=builtin:random-qwen3.5-27b"])
    assert validate(job, cfg, list(range(1000)))[0] == [1, 16, 31, 46, 61]
    for name, model_type in [("builtin:random-qwen3.5-35b-a3b", "qwen3_5_moe_text"),
                             ("builtin:random-qwen3-30b-a3b", "qwen3_moe")]:
        assert load_target_config(resolve_target_path(name, cache))["model_type"] == model_type
    # Qwen3.5-35B-A3B has no dense MLP width for the drafter to copy: validation names the setting.
    moe = load_target_config(resolve_target_path("builtin:random-qwen3.5-35b-a3b", cache))
    job = compose(["target.path=builtin:random-qwen3.5-35b-a3b"])
    with pytest.raises(ValueError, match=r"drafter config \(drafter.\*\): .*set drafter.intermediate_size"):
        validate(job, moe, list(range(1000)))
    job = compose(["target.path=builtin:random-qwen3.5-35b-a3b", "drafter.intermediate_size=4096"])
    assert validate(job, moe, list(range(1000)))[0] == [1, 19, 37]  # the tiny preset's 3 captured layers

    path = resolve_target_path("builtin:random-tiny-qwen3.5", cache)
    worker = TargetWorker.load(path, [0, 3], torch.device("cpu"), torch.float32, "sdpa")
    assert type(worker.model).__name__ == "Qwen3_5ForCausalLM" and len(worker.linear) == 3
    embed, _ = load_target_head(path, torch.float32, torch.device("cpu"))
    assert torch.equal(embed, worker.model.get_input_embeddings().weight)


def test_evaluate_live_on_a_hybrid_target_is_lossless(hybrid_target):
    """Item 4 through evaluate's live loop: every prompt's speculative output is greedy's, and the
    report counts the forwards that rolled the recurrent state back."""
    from dflash_mp.evaluate import EvalConfig, live

    drafter = _drafter(hybrid_target, 4)
    prompts = [[5, 17, 99, 3], [42, 8, 61, 7, 7, 1]]
    report, failures = live(hybrid_target, drafter, prompts, [], EvalConfig(max_new_tokens=12), 4)
    assert failures == [] and report["lossless"]
    assert report["generated_tokens"] == 24 and report["rollback_forwards"] > 0


@pytest.mark.parametrize("arch", ["tiny-qwen3.5", "tiny-qwen3-moe"])
def test_a_compiled_target_compiles_one_graph_per_layer_type(arch):
    """The compiled target compiles each decoder layer on its own and identical layers share one graph:
    8 layers of a hybrid are 2 graphs (linear and full attention), of a dense or MoE target 1. The
    features equal the eager ones, and a row of other documents compiles nothing new."""
    from dflash_mp.archs import hybrid_layer_types
    from dflash_mp.compile_stats import counts

    torch._dynamo.reset()
    hybrid = arch.startswith("tiny-qwen3.5")
    text = hf_config(TINY_ARCHS[arch], vocab_size=V, num_hidden_layers=8,
                     **({"layer_types": hybrid_layer_types(8)} if hybrid else {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(text, attn_implementation="sdpa").eval().requires_grad_(False)
    layer_ids = [1, 4, 7]
    eager = TargetWorker(model, layer_ids, torch.device("cpu"))
    compiled = TargetWorker(model, layer_ids, torch.device("cpu"), compile=True)
    before = counts()["graphs"]
    for seed, lens in enumerate(([70, 9, 33], [20, 64, 30])):
        pb = packed(lens, 128, seed)
        torch.testing.assert_close(compiled.forward(pb).hidden, eager.forward(pb).hidden, atol=2e-5, rtol=1e-4)
        if seed == 0:
            assert counts()["graphs"] - before == (2 if hybrid else 1)
            first = counts()["graphs"]
    assert counts()["graphs"] == first


@pytest.mark.parametrize("arch", ["tiny-qwen3.5-moe", "tiny-qwen3.5"])
def test_the_compiled_check_takes_each_layer_alone_and_refuses_a_wrong_one(arch):
    """check_compiled feeds every compiled layer the eager forward's input to it: right layers pass and
    stay compiled; one layer whose compiled form is off (here by 1%) sends the target back to eager."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(TINY_ARCHS[arch], vocab_size=V), attn_implementation="sdpa")
    worker = TargetWorker(model.eval(), [1, 3], torch.device("cpu"), compile=True)
    assert worker.check_compiled(128) < 1e-5 and worker.compiled
    right = worker._calls[2]

    def wrong(*args, **kwargs):  # a compiled layer 1% off
        out = right(*args, **kwargs)
        return 1.01 * (out[0] if isinstance(out, tuple) else out)

    worker._calls[2] = wrong
    assert worker.check_compiled(128) == pytest.approx(0.01, rel=1e-3)
    assert not worker.compiled and worker._calls is worker._eager_calls
    pb = packed([70, 9, 33], 128)
    torch.testing.assert_close(worker.forward(pb).hidden, TargetWorker(model, [1, 3], torch.device("cpu"))
                               .forward(pb).hidden, atol=0, rtol=0)


def test_rows_in_one_forward_keep_a_hybrid_targets_documents_apart(tmp_path):
    """target.rows_per_forward on Gated DeltaNet layers: rows laid end to end restart the recurrent state
    at each row's documents and padding, so each row captures what it captures alone."""
    path = save_target(tmp_path, "tiny-qwen3.5")
    worker = TargetWorker.load(path, [0, 2, 3], torch.device("cpu"), torch.float32, "sdpa")
    assert worker.linear
    rows = [packed([128], 128, seed=1), packed([70, 9, 33], 128, seed=2), packed([100], 128, seed=3)]
    for row, got in zip(rows, worker.forward_rows(rows)):
        torch.testing.assert_close(got.hidden, worker.forward(row).hidden, atol=1e-5, rtol=1e-4)
