"""A Qwen3.5 hybrid target on the GPU, at real width (4 layers: 3 Gated DeltaNet, 1 gated full
attention), bf16, as the job runs it: the varlen fla-core path equals the per-document path, the
compiled target equals the eager one with one graph per layer type, and the packing check passes it and refuses a
variant whose linear attention runs a packed row as one sequence."""

import pytest
import torch

from dflash_mp.archs import HF_ARCHS, hf_config, hybrid_layer_types
from dflash_mp.batch import PackedBatch
from dflash_mp.compile_stats import counts
from dflash_mp.target import TargetWorker, linear_attn, truncate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
LAYERS = [1, 3]
LENS = [700, 64, 1300, 5, 900]  # documents longer and shorter than fla's 64-token chunks
T = 3072


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    cfg = hf_config(HF_ARCHS["Qwen/Qwen3.5-27B"], num_hidden_layers=4, layer_types=hybrid_layer_types(4))
    torch.manual_seed(0)
    with torch.device(CUDA):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    truncate(m, max(LAYERS))
    return m.eval().requires_grad_(False)


def packed(seed=0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    n = sum(LENS)
    ids = torch.zeros(T, dtype=torch.long)
    ids[:n] = torch.randint(0, 240000, (n,), generator=g)
    pos, docs = torch.zeros(T, dtype=torch.long), torch.full((T,), -1, dtype=torch.long)
    o = 0
    for d, m in enumerate(LENS):
        pos[o:o + m], docs[o:o + m] = torch.arange(m), d
        o += m
    return PackedBatch(ids, pos, docs, (docs >= 0).long(), len(LENS), n)


def rel(a, b):
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def per_document_reference(model, pb):
    """Each document alone through the model's own layers (transformers' per-layer forward: its
    conv and delta rule on one sequence), captured as `hidden_states[i + 1]`."""
    dec, out, o = model.get_decoder(), [], 0
    with torch.inference_mode():
        for m in LENS:
            ids = pb.input_ids[o:o + m].to(CUDA)[None]
            pos = torch.arange(m, device=CUDA)[None]
            h = dec.embed_tokens(ids)
            rope = dec.rotary_emb(h, pos[None].expand(3, 1, -1))  # text ids as Qwen3.5's (t, h, w)
            caps = {}
            for i in range(max(LAYERS) + 1):
                h = dec.layers[i](h, attention_mask=None, position_ids=pos,
                                  position_embeddings=rope)
                h = h[0] if isinstance(h, tuple) else h
                caps[i] = dec.norm(h) if i == 3 else h
            out.append(torch.cat([caps[i][0] for i in LAYERS], dim=-1))
            o += m
    return torch.cat(out)


def test_varlen_fla_path_equals_the_per_document_path(model):
    if not linear_attn.fla_available():
        pytest.skip("fla-core is not installed (pip install -e '.[hybrid]')")
    worker = TargetWorker(model, LAYERS, CUDA)
    assert set(worker.linear.values()) == {"varlen"} and "fla-core" in worker.linear_how
    pb = packed()
    got = worker.forward(pb).hidden[: pb.num_valid_tokens]
    want = per_document_reference(model, pb)
    r = rel(got, want)
    print(f"varlen vs per-document: max {r.max():.2e}, mean {r.mean():.2e} (relative per token, bf16)")
    assert r.max() < 5e-2 and r.mean() < 3e-2


def test_compiled_target_equals_eager_with_a_graph_per_layer_type_and_never_recompiles(model):
    from torch._dynamo.utils import counters

    eager = TargetWorker(model, LAYERS, CUDA)
    compiled = TargetWorker(model, LAYERS, CUDA, compile=True)
    breaks = sum(counters["graph_break"].values())
    before = counts()["graphs"]
    for seed in range(3):  # other documents, same shapes: nothing recompiles after the first
        pb = packed(seed)
        want = eager.forward(pb).hidden
        got = compiled.forward(pb).hidden
        r = rel(got, want)[: pb.num_valid_tokens]
        print(f"compiled vs eager, row {seed}: max {r.max():.2e}, mean {r.mean():.2e}")
        assert r.max() < 5e-2 and r.mean() < 3e-2
        if seed == 0:
            after_first = counts()["graphs"]
            assert after_first - before == 2  # the 3 linear-attention layers share one graph
    assert sum(counters["graph_break"].values()) == breaks  # the varlen ops are custom ops, not breaks
    assert counts()["graphs"] == after_first


def test_packing_check_passes_it_and_refuses_linear_attention_across_documents(model):
    worker = TargetWorker(model, LAYERS, CUDA)
    diffs = worker.check_packing()
    print("packing check, per layer:", {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) < 2e-2
    leaky = TargetWorker(model, LAYERS, CUDA, cross_documents=True)
    with pytest.raises(ValueError, match=r"layer 0 \(linear_attention\) lets packed documents see each other"):
        leaky.check_packing()


def test_flex_attention_through_the_registered_function_equals_sdpa(model):
    """transformers has no flex_attention for Qwen3.5; asked for, its full-attention layer runs the
    registered function on the packed block mask and captures what sdpa with the dense mask does."""
    from dflash_mp.target import FLEX_OUTSIDE_GRAPH

    pb = packed()
    want = TargetWorker(model, LAYERS, CUDA).forward(pb).hidden
    model.config._attn_implementation = "flex_attention"
    try:
        flex = TargetWorker(model, LAYERS, CUDA)
        assert model.config._attn_implementation == FLEX_OUTSIDE_GRAPH and flex.flex
        got = flex.forward(pb).hidden
    finally:
        model.config._attn_implementation = "sdpa"
    r = rel(got, want)[: pb.num_valid_tokens]
    print(f"flex (registered) vs sdpa: max {r.max():.2e}, mean {r.mean():.2e}")
    assert r.max() < 5e-2 and r.mean() < 3e-2


def test_the_triton_kernel_equals_sdpa_on_the_full_attention_layer(model):
    """`auto` runs Qwen3.5's full-attention layers (head_dim 256, gated output) on the Triton
    packed-document kernel: its captures equal sdpa's with the dense mask, eager and compiled, and the
    compiled layers have no graph break."""
    from torch._dynamo.utils import counters

    from dflash_mp.target.doc_attn import ATTN_NAME

    pb = packed()
    want = TargetWorker(model, LAYERS, CUDA).forward(pb).hidden
    model.config._attn_implementation = "triton"
    try:
        eager = TargetWorker(model, LAYERS, CUDA)
        assert model.config._attn_implementation == ATTN_NAME and eager.triton
        breaks = sum(counters["graph_break"].values())
        compiled = TargetWorker(model, LAYERS, CUDA, compile=True)
        runs = {"eager": eager.forward(pb).hidden, "compiled": compiled.forward(pb).hidden}
        assert sum(counters["graph_break"].values()) == breaks
    finally:
        model.config._attn_implementation = "sdpa"
    for name, got in runs.items():
        r = rel(got, want)[: pb.num_valid_tokens]
        print(f"triton ({name}) vs sdpa: max {r.max():.2e}, mean {r.mean():.2e}")
        assert r.max() < 5e-2 and r.mean() < 3e-2
