"""The target's forward as one CUDA graph (target/graph.py): which targets get one, and (on a GPU)
that a replay gives the forward's own features, row after row, without overwriting a batch already
handed on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3MoeConfig

from dflash_mp.target import TargetConfig, TargetWorker
from dflash_mp.target.graph import unsupported
from test_target import packed
from test_target_varlen import tiny_qwen3

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def test_the_job_replays_the_target_forward_as_a_graph_by_default():
    assert TargetConfig().cuda_graph is True


def test_which_targets_can_be_captured():
    dense = Qwen3Config(num_hidden_layers=2)
    assert unsupported(CUDA, "triton", False, dense, "layers") is None
    assert "no GPU" in unsupported(CPU, "triton", False, dense, "layers")
    assert "flex_attention" in unsupported(CUDA, "flex_attention", False, dense, "layers")
    assert "linear-attention" in unsupported(CUDA, "triton", True, dense, "layers")
    assert "MoE" in unsupported(CUDA, "triton", False, Qwen3MoeConfig(num_hidden_layers=2, num_experts=8), "layers")
    assert "compile_scope=forward" in unsupported(CUDA, "triton", False, dense, "forward")


def test_a_cpu_worker_has_no_graph_and_says_why():
    model = tiny_qwen3(CPU, torch.float32)
    model.config._attn_implementation = "sdpa"
    worker = TargetWorker(model, [1, 2, 3], CPU, cuda_graph=True)
    assert worker.graph is None and worker.describe_graph() == "off (no GPU)"
    assert TargetWorker(model, [1, 2, 3], CPU).describe_graph() == "off (target.cuda_graph=false)"
    worker.graph_why, worker.graph = None, SimpleNamespace(failed=None)  # a GPU worker's graph, its states
    assert worker.describe_graph() == "on (the forward is replayed as one CUDA graph)"
    worker.graph.failed = "RuntimeError: operation not permitted when stream is capturing"
    assert worker.describe_graph() == ("off (the capture failed: RuntimeError: operation not permitted when stream "
                                       "is capturing; the forwards run launched)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_the_replayed_forward_equals_the_launched_one_row_after_row(compiled):
    """A tiny Qwen3 (bf16, head_dim 128, sliding-window layers) through the Triton kernel: the first
    row runs launched (and is captured), later rows are replays. Each equals the uncaptured worker's
    features for its row (rows of other document counts: the ranges are rebuilt inside the graph),
    and a batch handed on keeps its values when the next replay runs."""
    model = tiny_qwen3(CUDA, torch.bfloat16, 300, head_dim=128)
    model.config._attn_implementation = "triton"
    rows = [packed([300, 520, 130], 1024, 96), packed([100, 400, 60, 250, 200], 1024, 96, seed=1),
            packed([1024], 1024, 96, seed=2), packed([300, 520, 130], 1024, 96, seed=3)]
    plain = TargetWorker(model, [1, 2, 3], CUDA, compile=compiled)
    want = [plain.forward(pb).hidden.clone() for pb in rows]
    worker = TargetWorker(model, [1, 2, 3], CUDA, compile=compiled, cuda_graph=True)
    assert worker.graph is not None, worker.graph_why
    got = [worker.forward(pb).hidden for pb in rows]
    assert worker.graph.failed is None and worker.graph.replays == len(rows) - 1
    torch.cuda.synchronize()
    for g, w, pb in zip(got, want, rows):  # every output read after the last replay: none was overwritten
        n = pb.num_valid_tokens
        rel = float(((g[:n] - w[:n]).float().norm(dim=-1) / w[:n].float().norm(dim=-1)).max())
        assert rel < 1e-2, rel
    assert not torch.equal(got[0], got[3])  # same documents, other tokens: the ids are the replay's own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_in_one_replayed_forward_equal_each_row_launched_alone():
    """target.rows_per_forward=2 as the job runs it (compiled layers, the Triton kernel, the forward as
    one CUDA graph): every row's features, its padding excluded, within bf16 rounding of the row's own
    uncaptured forward, over two replays of the joined pair; one graph, captured once."""
    model = tiny_qwen3(CUDA, torch.bfloat16, 300, head_dim=128)
    model.config._attn_implementation = "triton"
    rows = [packed([1024], 1024, 96), packed([100, 400, 60, 250, 200], 1024, 96, seed=1),
            packed([300, 520, 130], 1024, 96, seed=2), packed([1024], 1024, 96, seed=3)]
    plain = TargetWorker(model, [1, 2, 3], CUDA, compile=True)
    want = [plain.forward(pb).hidden.clone() for pb in rows]
    worker = TargetWorker(model, [1, 2, 3], CUDA, compile=True, cuda_graph=True)
    got = [hb.hidden for i in (0, 2) for hb in worker.forward_rows(rows[i:i + 2])]
    assert worker.graph.failed is None and len(worker.graph.graphs) == 1 and worker.graph.replays == 1
    torch.cuda.synchronize()
    for g, w, pb in zip(got, want, rows):
        n = pb.num_valid_tokens
        rel = float(((g[:n] - w[:n]).float().norm(dim=-1) / w[:n].float().norm(dim=-1)).max())
        assert rel < 1e-2, rel
