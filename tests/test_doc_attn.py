"""The target's Triton packed-document attention (target.attn_implementation=triton, doc_attn.py)
against the dense document mask it replaces.

The visible ranges (each row's first key, the tile order) are checked on CPU against the dense mask.
The kernel is checked against dense sdpa on CPU in Triton's interpreter (tests/triton_interp.py) with
small tiles, so one row crosses masked, unmasked and diagonal tiles; and a tiny Qwen3 target run
through it equals the sdpa worker, eager and compiled as one graph per layer. On CUDA, in bf16 at
real tiles (the `gpu` tests).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import triton_interp
from dflash_mp.compile_stats import counts
from dflash_mp.target import TargetWorker, attention
from dflash_mp.target.attention import block_diagonal_causal_mask, choose_attention, describe_attention, load_attention
from dflash_mp.target.doc_attn import ATTN_NAME, DocRows, doc_rows, unsupported
from dflash_mp.triton_launch import use_tma
from test_target import packed
from test_target_varlen import check_against_sdpa, tiny_qwen3, worker_with

CPU, CUDA = torch.device("cpu"), torch.device("cuda")

# (T, Hq, Hkv, D, window, document lengths; the rest of T is padding)
CASES = [
    (200, 4, 2, 64, None, [37, 90, 50]),  # documents starting inside tiles, padding at the end
    (200, 4, 2, 64, 23, [37, 90, 50]),  # a sliding window shorter than the tiles
    (160, 2, 2, 64, None, [160]),  # one document, T a multiple of the tiles: every middle tile unmasked
    (150, 6, 2, 64, 70, [1, 64, 5, 80]),  # a 1-token document, 3 query heads per KV head, T not a tile multiple
]
SMALL_TILES = {64: (32, 16, 4, 1)}  # 32-row query tiles over 16-key tiles: many tiles of each kind


def dense(docs: torch.Tensor, window=None) -> torch.Tensor:
    return block_diagonal_causal_mask(docs, window)[0, 0]


def doc_ids(T, lens) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lens)] + [torch.full((T - sum(lens),), -1)])


# ----------------------------------------------------------------------------------- the ranges (CPU)
@pytest.mark.parametrize("T,Hq,Hkv,D,window,lens", CASES)
def test_each_row_sees_exactly_the_keys_of_the_dense_mask(T, Hq, Hkv, D, window, lens):
    """Row i sees [low_i, i] in the dense mask; low ascends (the kernel's unmasked tiles rely on it);
    the tile order puts the tiles with the most keys first and lists each tile once."""
    docs = doc_ids(T, lens)
    rows = doc_rows(docs, D, window)
    keys = torch.arange(T)
    ranges = (keys[None, :] >= rows.low[:, None].long()) & (keys[None, :] <= keys[:, None])
    assert torch.equal(ranges, dense(docs, window))
    assert bool((rows.low[1:] >= rows.low[:-1]).all())
    bm = rows.block_m
    n_keys = [min(m0 + bm, T) - int(rows.low[m0]) for m0 in range(0, T, bm)]
    assert sorted(rows.order.tolist()) == list(range(len(n_keys)))
    assert [n_keys[i] for i in rows.order.tolist()] == sorted(n_keys, reverse=True)


def test_the_choice_of_the_kernel():
    """auto: the kernel on CUDA with Triton, else flex_attention where transformers supports it, sdpa
    where it does not and on CPU; asked for without Triton: refused, naming the fix. Shapes without
    tiles are named."""
    from transformers import Qwen3ForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    real = attention.triton_available
    try:
        attention.triton_available = lambda device: True
        assert choose_attention("auto", CUDA, Qwen3ForCausalLM) == "triton"
        assert choose_attention("auto", CUDA, Qwen3_5ForCausalLM) == "triton"
        assert choose_attention("auto", CPU, Qwen3ForCausalLM) == "sdpa"
        attention.triton_available = lambda device: False
        assert choose_attention("auto", CUDA, Qwen3ForCausalLM) == "flex_attention"
        assert choose_attention("auto", CUDA, Qwen3_5ForCausalLM) == "sdpa"
        with pytest.raises(ValueError, match="attn_implementation=triton needs Triton on CUDA .* use target"):
            choose_attention("triton", CPU, Qwen3ForCausalLM)
    finally:
        attention.triton_available = real
    assert load_attention("triton", Qwen3ForCausalLM) == "sdpa"
    assert ATTN_NAME in describe_attention("triton", Qwen3ForCausalLM, True)
    assert "flash" not in ATTN_NAME  # transformers reads any "...flash..." name as flash attention
    assert unsupported(128, torch.bfloat16) is None and unsupported(256, torch.bfloat16) is None
    assert "head_dim=80" in unsupported(80, torch.bfloat16)
    # The GPU's shared memory a block (bytes): the H200 and the A100 run every head_dim; a 99 KiB GPU
    # (L40S, A10, RTX) all but 256, whose tiles ask for 100 KiB there (bench/kernel_resources.py).
    for have in (232448, 166912):
        assert all(unsupported(d, torch.bfloat16, have) is None for d in (64, 128, 256))
    assert all(unsupported(d, torch.bfloat16, 101376) is None for d in (64, 128))
    assert "99 KiB of shared memory" in unsupported(256, torch.bfloat16, 101376)


def test_auto_falls_back_where_the_kernel_has_no_tiles(caplog, monkeypatch):
    """A target whose head_dim the kernel has no tiles for, or whose tiles do not fit the GPU's shared
    memory, runs `auto` on flex_attention (sdpa where transformers has no flex for the class), logged;
    the loaded model's config and the GPU decide."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    from dflash_mp.target import worker
    from dflash_mp.target.worker import triton_or_fallback

    cpu = torch.device("cpu")
    odd = Qwen3Config(hidden_size=320, num_attention_heads=4, head_dim=80)
    with caplog.at_level("INFO"):
        assert triton_or_fallback(odd, Qwen3ForCausalLM, torch.bfloat16, cpu) == "flex_attention"
    assert "head_dim=80" in caplog.text
    assert triton_or_fallback(odd, Qwen3_5ForCausalLM, torch.bfloat16, cpu) == "sdpa"
    assert triton_or_fallback(Qwen3Config(head_dim=128), Qwen3ForCausalLM, torch.bfloat16, cpu) == "triton"
    # On a GPU with 99 KiB a block (what triton_launch.shared_memory reads from Triton on an sm_86,
    # sm_89 or sm_120), the 27B's head_dim 256 runs on the fallback and head_dim 128 keeps the kernel.
    monkeypatch.setattr(worker, "shared_memory", lambda device: 101376)
    caplog.clear()
    with caplog.at_level("INFO"):
        big = triton_or_fallback(Qwen3Config(head_dim=256), Qwen3_5ForCausalLM, torch.bfloat16, cpu)
    assert big == "sdpa"
    assert "99 KiB of shared memory" in caplog.text
    assert triton_or_fallback(Qwen3Config(head_dim=128), Qwen3ForCausalLM, torch.bfloat16, cpu) == "triton"


def test_the_kernel_asked_for_on_a_gpu_it_does_not_fit_is_refused_naming_the_fix(monkeypatch):
    """`target.attn_implementation=triton` with head_dim 256 on a 99 KiB GPU (sm_86, sm_89): refused
    before any compile, with the choices that run there."""
    from dflash_mp.target import worker

    model = tiny_qwen3("cpu", torch.float32, head_dim=256)
    model.config._attn_implementation = "triton"
    monkeypatch.setattr(worker, "shared_memory", lambda device: 101376)
    with pytest.raises(ValueError, match="99 KiB of shared memory.*target.attn_implementation=auto, flex"):
        TargetWorker(model, [1, 3], torch.device("cpu"))


def test_the_kernel_asked_for_on_cpu_is_refused_at_load(tmp_path):
    from dflash_mp.builtin import resolve_target_path

    path = resolve_target_path("builtin:tiny-qwen3", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="needs Triton on CUDA"):
        TargetWorker.load(path, [1, 2], CPU, torch.float32, "triton", packing_check=False)


def test_key_tiles_that_do_not_divide_the_query_tiles_are_refused(monkeypatch):
    """The kernel's diagonal starts at a key tile: 128-key tiles over 64-row query tiles would read
    keys past the diagonal unmasked."""
    from dflash_mp.target import doc_attn

    monkeypatch.setitem(doc_attn.TILES, 64, (64, 128, 4, 2))
    docs = doc_ids(100, [40, 60])
    q = torch.zeros(100, 2, 64)
    with pytest.raises(ValueError, match=r"BLOCK_N=128 must divide BLOCK_M=64 \(doc_attn.TILES\[64\]\)"):
        doc_attn.doc_attention(q, q, q, doc_rows(docs, 64))


# ---------------------------------------------------------------------- the kernel (interpreter, CPU)
def compare(T, Hq, Hkv, D, window, lens, device="cpu", dtype=torch.float32, compiled=False, q_layout="thd"):
    """The kernel's output against fp32 dense sdpa on the document mask: relative L2 error.
    `q_layout="htd"`: q, k, v are [H, T, D] tensors handed over as [T, H, D] views (transformers' layout)."""
    from dflash_mp.target import doc_attn
    from dflash_mp.target.doc_attn import doc_attention

    docs = doc_ids(T, lens).to(device)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, h, D, generator=g).to(device, dtype) for h in (Hq, Hkv, Hkv))
    if q_layout == "htd":
        q, k, v = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
    assert doc_attn.USE_TMA is not True or use_tma(True, k, v)  # forced: the descriptors can take these
    rows = doc_rows(docs, D, window)
    fn = torch.compile(doc_attention, fullgraph=True) if compiled else doc_attention
    out = fn(q, k, v, rows)
    assert out.shape == q.shape and out.is_contiguous()
    qf, kf, vf = (x.float().transpose(0, 1)[None] for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=dense(docs, window), enable_gqa=True)[0]
    ref = ref.transpose(0, 1)
    return float((out.float() - ref).norm() / ref.norm())


def check_kernel() -> None:
    from dflash_mp.target import doc_attn

    doc_attn.TILES.update(SMALL_TILES)
    for tma in (False, True):  # key/value tiles through pointers, then through tensor descriptors
        doc_attn.USE_TMA = tma
        for case in CASES:
            for layout in ("thd", "htd"):
                err = compare(*case, q_layout=layout)
                assert err < 1e-5, (tma, case, layout, err)
    doc_attn.TILES[64] = (32, 32, 4, 1)  # key tiles as large as the query tiles
    err = compare(*CASES[0])
    assert err < 1e-5, err


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
def test_the_kernel_equals_dense_attention_in_the_triton_interpreter():
    run = triton_interp.run("test_doc_attn", "check_kernel()")
    assert run.returncode == 0, run.stderr[-3000:]


def check_worker() -> None:
    """A tiny Qwen3 (head_dim 64, sliding-window layers) through the kernel equals the sdpa worker on
    rows of other document counts; compiled, each layer is one graph (the op inside it, no break) and
    a row of another document count compiles nothing new; the packing check passes."""
    from dflash_mp.target import doc_attn

    doc_attn.TILES.update(SMALL_TILES)
    model = tiny_qwen3(CPU, torch.float32, window=20, head_dim=64)
    rows = [packed([37, 50, 30], 128, 96), packed([3, 60, 4, 26, 2], 128, 96, seed=1), packed([128], 128, 96, seed=2)]
    eager, graphs = check_against_sdpa(model, "triton", rows, (64, 96))
    assert eager.triton and model.config._attn_implementation == ATTN_NAME
    assert isinstance(eager.masks(rows[0].doc_ids)["sliding_attention"], DocRows)
    from torch._dynamo.utils import counters

    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert graphs <= 2, graphs  # the layers share their graph (at most one per kind: full, sliding)
    # Rows in one forward (target.rows_per_forward): a one-document row without padding, then a row whose
    # first document has id 0 too; each row captures what it captures alone.
    joined = [rows[2], rows[1], rows[0]]
    for pb, got in zip(joined, eager.forward_rows(joined)):
        torch.testing.assert_close(got.hidden, eager.forward(pb).hidden, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
def test_a_target_through_the_kernel_equals_the_sdpa_one_in_the_triton_interpreter():
    run = triton_interp.run("test_doc_attn", "check_worker()")
    assert run.returncode == 0, run.stderr[-3000:]


# ------------------------------------------------------------------------------------- the GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("window", [None, 300])
def test_the_kernel_equals_dense_attention_on_cuda(D, window):
    """bf16 at the real tiles, eager and compiled, GQA of 4 and T not a tile multiple; key/value tiles
    through tensor descriptors (the default on sm_90+) and through pointers."""
    from dflash_mp.target import doc_attn

    try:
        for tma in (None, False):
            doc_attn.USE_TMA = tma
            for compiled in (False, True):
                err = compare(1000, 8, 2, D, window, [130, 511, 300], device="cuda", dtype=torch.bfloat16,
                              compiled=compiled, q_layout="htd")
                assert err < 1e-2, (tma, compiled, err)
    finally:
        doc_attn.USE_TMA = None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_target_through_the_kernel_equals_flex_on_cuda():
    """A tiny Qwen3 (bf16, head_dim 128, sliding-window layers) compiled as the job runs it: captures
    within bf16 rounding of flex_attention's; no graph break; a row of another document count
    compiles nothing new."""
    from torch._dynamo.utils import counters

    model = tiny_qwen3(CUDA, torch.bfloat16, 300, head_dim=128)
    rows = [packed([300, 520, 130], 1024, 96), packed([100, 400, 60, 250, 200], 1024, 96, seed=1)]
    flex = [worker_with(model, "flex_attention", CUDA).forward(pb).hidden for pb in rows]
    worker = worker_with(model, "triton", CUDA, compile=True)
    breaks = sum(counters["graph_break"].values())
    graphs = counts()["graphs"]
    worker.forward(rows[0])
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    compiled_now = counts()["graphs"]
    assert compiled_now <= graphs + 2  # the layers share their graph (at most one per kind: full, sliding)
    for pb, f in zip(rows, flex):
        got, n = worker.forward(pb).hidden.float(), pb.num_valid_tokens
        rel = (got[:n] - f[:n].float()).norm(dim=-1) / f[:n].float().norm(dim=-1)
        print(f"triton vs flex: max {float(rel.max()):.2e}, mean {float(rel.mean()):.2e} (relative per token, bf16)")
        assert float(rel.max()) < 2e-2, float(rel.max())
    assert counts()["graphs"] == compiled_now
