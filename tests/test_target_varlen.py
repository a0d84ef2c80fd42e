"""`target.attn_implementation=varlen`: FlashAttention-2's varlen kernel on the packed row's documents.

The kernel has no CPU form: on the CPU the row's bounds, the adaptation to each torch version's
signature and the refusals are tested, and the whole worker path runs with a reference kernel in
PyTorch standing in (same signature and semantics). The real kernel is compared with flex_attention
and sdpa on the GPU (`test_varlen_captures_equal_flex_and_sdpa_on_cuda`)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_mp.compile_stats import counts
from dflash_mp.target import VARLEN_OUTSIDE_GRAPH, TargetWorker, attention, truncate, worker as worker_mod
from dflash_mp.target.attention import VarlenKernel, check_varlen, choose_attention, describe_attention, load_attention
from dflash_mp.target.linear_attn import Spans
from test_target import packed

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def tiny_qwen3(device, dtype, window=None, head_dim=8):
    """A 4-layer Qwen3 from its config (4 query heads, 2 key/value heads); `window`: layers 2.. are
    sliding-window layers of that width."""
    sliding = dict(use_sliding_window=True, max_window_layers=2, sliding_window=window) if window else {}
    cfg = Qwen3Config(vocab_size=96, hidden_size=4 * head_dim, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096,
                      **sliding)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    truncate(model, 3)
    return model.eval().requires_grad_(False)


def worker_with(model, attn, device, compile=False):
    model.config._attn_implementation = attn
    return TargetWorker(model, [1, 2, 3], device, compile=compile)


def check_against_sdpa(model, attn, rows, packing_lengths):
    """A CPU worker through `attn` captures what the sdpa worker does on `rows`, eager and compiled; its
    packing check passes; compiled, rows of other document counts compile nothing new. Returns the
    eager worker and the graphs compiled so far (compile_stats.counts)."""
    want = [worker_with(model, "sdpa", CPU).forward(pb).hidden for pb in rows]
    eager = worker_with(model, attn, CPU)
    for pb, w in zip(rows, want):
        torch.testing.assert_close(eager.forward(pb).hidden, w, rtol=1e-4, atol=1e-5)
    eager.check_packing(lengths=packing_lengths)
    compiled = worker_with(model, attn, CPU, compile=True)
    torch.testing.assert_close(compiled.forward(rows[0]).hidden, want[0], rtol=1e-4, atol=1e-5)
    graphs = counts()["graphs"]
    for pb, w in zip(rows[1:], want[1:]):
        torch.testing.assert_close(compiled.forward(pb).hidden, w, rtol=1e-4, atol=1e-5)
    assert counts()["graphs"] == graphs
    return eager, graphs


# ------------------------------------------------------------------------------ the row's bounds
@pytest.mark.parametrize("docs,bounds", [
    ([0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 3, 5, 9]),  # several documents, no padding
    ([0, 0, 1, 1, 1, -1, -1], [0, 2, 5, 7]),  # trailing padding is a span of its own: every token covered
    ([0, 0, 0, 0, 0], [0, 5]),  # a single document
    ([0, 0, 0, -1], [0, 3, 4]),
])
def test_spans_give_the_cu_seqlens_of_a_packed_row(docs, bounds):
    spans = Spans.of(torch.tensor(docs), CPU)
    assert spans.cpu.tolist() == bounds and spans.device.tolist() == bounds
    assert spans.int32.dtype == torch.int32 and spans.int32.tolist() == bounds
    assert spans.int32[-1] == len(docs)  # FlashAttention requires cu_seqlens[-1] == T
    assert spans.longest == max(b - a for a, b in zip(bounds[:-1], bounds[1:]))


# ------------------------------------------------------------------- one signature per torch version
def _recorder(form):
    """A stand-in for varlen_attn with torch `form`'s signature that records how it is called."""
    calls = []

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, *, return_aux=None,
                   scale=None):
        calls.append(((query, key, value, cu_seq_q, cu_seq_k, max_q, max_k),
                      dict(is_causal=is_causal, scale=scale)))
        return query

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):
        calls.append(((query, key, value, cu_seq_q, cu_seq_k, max_q, max_k), dict(scale=scale, window_size=window_size)))
        return query

    def torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.append(((query, key, value, cu_seq_q, cu_seq_k, max_q, max_k),
                      dict(scale=scale, window_size=window_size, enable_gqa=enable_gqa)))
        return query

    return {"2.10": torch_2_10, "2.11": torch_2_11, "2.13": torch_2_13}[form], calls


@pytest.mark.parametrize("form,heads_kv,window,want", [
    ("2.10", 2, None, dict(is_causal=True, scale=0.5)),
    ("2.11", 2, None, dict(scale=0.5, window_size=(-1, 0))),
    ("2.11", 2, 4, dict(scale=0.5, window_size=(3, 0))),  # q - kv < 4: three tokens back
    ("2.13", 2, None, dict(scale=0.5, window_size=(-1, 0), enable_gqa=True)),  # fewer kv heads
    ("2.13", 4, None, dict(scale=0.5, window_size=(-1, 0), enable_gqa=False)),
    ("2.13", 2, 4, dict(scale=0.5, window_size=(3, 0), enable_gqa=True)),
])
def test_the_kernel_is_called_as_each_torch_version_takes_it(form, heads_kv, window, want):
    fn, calls = _recorder(form)
    kernel = VarlenKernel(fn)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, heads_kv, 8), torch.randn(9, heads_kv, 8)
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    assert kernel(q, k, v, cu, 6, 0.5, window) is q
    (args, kwargs), = calls
    assert args[:3] == (q, k, v) and args[3] is cu and args[4] is cu and args[5:] == (6, 6)
    assert kwargs == want


def test_a_kernel_without_windows_is_refused_for_sliding_window_layers(monkeypatch):
    """torch 2.10's form has no window_size: a sliding-window target is refused at load, and a call
    with a window raises rather than running full causal attention."""
    fn, _ = _recorder("2.10")
    kernel = VarlenKernel(fn)
    with pytest.raises(ValueError, match="no window_size"):
        kernel(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.tensor([0, 4]), 4, None, 2)
    monkeypatch.setattr(attention, "varlen_kernel", lambda: kernel)
    check_varlen(CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match=r"no window_size, and the target has sliding-window layers \(window 4\)"):
        check_varlen(CUDA, torch.bfloat16, window=4)
    with pytest.raises(ValueError, match="neither is_causal nor window_size"):
        VarlenKernel(lambda query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None: query)


def test_the_installed_kernel_is_read_from_its_signature():
    kernel = attention.varlen_kernel()
    if kernel is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    assert kernel.windows or kernel.causal_flag


# -------------------------------------------------------------------------------------- choosing it
def test_varlen_is_chosen_only_on_cuda_and_auto_is_unchanged(tmp_path, monkeypatch):
    from transformers import Qwen3ForCausalLM

    monkeypatch.setattr(attention, "triton_available", lambda device: False)

    with pytest.raises(ValueError, match=r"attn_implementation='varlen' .* runs on CUDA only.*use "
                                         r"target.attn_implementation=sdpa or auto"):
        choose_attention("varlen", CPU, Qwen3ForCausalLM)
    with pytest.raises(ValueError, match=r"'flash': use auto or one of triton, sdpa, flex_attention, varlen, eager"):
        choose_attention("flash", CUDA, Qwen3ForCausalLM)
    with pytest.raises(ValueError, match="runs in bfloat16 or float16, not torch.float32"):
        check_varlen(CUDA, torch.float32)
    assert choose_attention("auto", CUDA, Qwen3ForCausalLM) == "flex_attention"
    assert choose_attention("auto", CPU, Qwen3ForCausalLM) == "sdpa"
    if attention.varlen_kernel() is not None:
        assert choose_attention("varlen", CUDA, Qwen3ForCausalLM) == "varlen"
    assert load_attention("varlen", Qwen3ForCausalLM) == "sdpa"
    assert describe_attention("varlen", Qwen3ForCausalLM, True).startswith(f"varlen (FlashAttention-2 over the "
                                                                           f"row's documents, registered as "
                                                                           f"{VARLEN_OUTSIDE_GRAPH}")
    assert "flash" not in VARLEN_OUTSIDE_GRAPH  # transformers reads any "...flash..." name as flash attention


def test_varlen_asked_for_on_cpu_is_refused_at_load(tmp_path):
    from dflash_mp.builtin import resolve_target_path

    path = resolve_target_path("builtin:tiny-qwen3", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"'varlen' .* runs on CUDA only, and this target runs on cpu"):
        TargetWorker.load(path, [1, 2], CPU, torch.float32, "varlen", packing_check=False)
    model = tiny_qwen3(CPU, torch.float32)
    with pytest.raises(ValueError, match="runs on CUDA only"):
        worker_with(model, "varlen", CPU)


# --------------------------------------------------------------- the worker path, reference kernel
def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's varlen_attn in plain PyTorch: each span alone, FlashAttention's (left, right) window."""
    assert cu_seq_q.dtype == torch.int32 and cu_seq_q is cu_seq_k and int(cu_seq_q[-1]) == query.shape[0]
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError("fewer kv heads without enable_gqa")
    out = torch.empty_like(query)
    b = cu_seq_q.tolist()
    for s, e in zip(b[:-1], b[1:]):
        assert e - s <= max_q == max_k
        i, j = torch.arange(e - s)[:, None], torch.arange(e - s)[None]
        left, right = window_size
        seen = torch.ones(e - s, e - s, dtype=torch.bool)
        if left >= 0:
            seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
        o = F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (query, key, value)), attn_mask=seen,
                                           scale=scale, enable_gqa=enable_gqa)
        out[s:e] = o.transpose(0, 1)
    return out


@pytest.fixture
def reference_kernel(monkeypatch):
    """The worker path on the CPU: the reference kernel, and no CUDA-only refusal."""
    monkeypatch.setattr(attention, "varlen_kernel", lambda: VarlenKernel(reference_varlen))
    monkeypatch.setattr(worker_mod, "check_varlen", lambda *a, **k: None)


@pytest.mark.parametrize("window", [None, 4])
def test_the_worker_runs_varlen_on_the_rows_documents(reference_kernel, window):
    """With the reference kernel: captures equal sdpa's with the dense document mask (sliding-window
    layers included), eager and compiled; the compiled layers take rows of another document count
    without a new graph (the bounds never enter the graph); the packing check passes."""
    model = tiny_qwen3(CPU, torch.float32, window)
    rows = [packed([7, 12, 5], 32, 96), packed([3, 9, 4, 6, 2], 32, 96, seed=1), packed([32], 32, 96, seed=2)]
    eager, _ = check_against_sdpa(model, "varlen", rows, (16, 24))
    assert eager.varlen and model.config._attn_implementation == VARLEN_OUTSIDE_GRAPH
    assert eager.masks(rows[0].doc_ids) == {t: None for t in eager.masks(rows[0].doc_ids)}


def test_the_varlen_function_runs_only_inside_the_worker(reference_kernel):
    model = tiny_qwen3(CPU, torch.float32)
    worker_with(model, "varlen", CPU)
    with pytest.raises(RuntimeError, match=f"{VARLEN_OUTSIDE_GRAPH} ran outside TargetWorker's forward"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))


# ---------------------------------------------------------------------------- the real kernel (GPU)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 200])
def test_varlen_captures_equal_flex_and_sdpa_on_cuda(window):
    """torch's FlashAttention-2 varlen kernel on a packed row of 3 documents and padding (bf16, GQA,
    head_dim 64; sliding-window layers of 200 tokens): its captures equal flex_attention's and sdpa's,
    eager and compiled; a row of another document count compiles nothing new, and the forward never
    syncs the host."""
    model = tiny_qwen3(CUDA, torch.bfloat16, window, head_dim=64)
    rows = [packed([300, 520, 130], 1024, 96), packed([100, 400, 60, 250, 200], 1024, 96, seed=1)]

    def rel(a, b):
        a, b = a.float(), b.float()
        return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)

    sdpa = [worker_with(model, "sdpa", CUDA).forward(pb).hidden for pb in rows]
    flex = [worker_with(model, "flex_attention", CUDA).forward(pb).hidden for pb in rows]
    eager = worker_with(model, "varlen", CUDA)
    compiled = worker_with(model, "varlen", CUDA, compile=True)
    assert model.config._attn_implementation == VARLEN_OUTSIDE_GRAPH
    compiled.forward(rows[0])
    graphs = counts()["graphs"]
    for pb, s, f in zip(rows, sdpa, flex):
        n = pb.num_valid_tokens
        for name, got in (("eager", eager.forward(pb).hidden), ("compiled", compiled.forward(pb).hidden)):
            for ref_name, ref in (("sdpa", s), ("flex", f)):
                r = rel(got, ref)[:n]
                print(f"varlen {name} vs {ref_name}, {pb.num_docs} docs: max {r.max():.2e}, mean {r.mean():.2e}")
                assert r.max() < 5e-2 and r.mean() < 1e-2
    assert counts()["graphs"] == graphs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for w in (eager, compiled):
            w.forward(rows[1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    eager.check_packing()
