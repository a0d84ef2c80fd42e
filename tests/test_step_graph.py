"""train.cuda_graph: where the drafter's step is captured and where not (and why), and the interval
sums a captured step adds into. That replays equal launched steps is checked on CUDA
(tests/test_trainer_compile.py): a CUDA graph cannot be captured on CPU."""

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.step_graph import CAPTURE_AT, StepGraph, unsupported
from dflash_mp.trainer import DFlashObjective, DrafterConfig, DrafterTrainer, IntervalStats, TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import synthetic_batch  # noqa: E402

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_the_step_is_captured_only_where_it_can_be():
    assert unsupported(CUDA, "default", 1, "triton") is None
    assert unsupported(CUDA, "eager", 1, "triton") is None
    assert unsupported(CPU, "eager", 1, "dense") == "no GPU"
    assert "records CUDA graphs of its own" in unsupported(CUDA, "reduce-overhead", 1, "triton")
    assert "2 drafter replicas" in unsupported(CUDA, "default", 2, "triton")
    assert "drafter attention flex" in unsupported(CUDA, "default", 1, "flex")


def _trainer(graph: bool) -> DrafterTrainer:
    args = DrafterArgs(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                       vocab_size=256, target_layer_ids=[1, 2, 3], block_size=4, mask_token_id=255)
    torch.manual_seed(0)
    embed, head = torch.randn(256, 32) * 0.02, torch.randn(256, 32) * 0.02
    obj = DFlashObjective(DFlashDrafter(args), args, embed, head,
                          DrafterConfig(block_size=4, num_anchors=16, max_anchors_per_doc=8, gamma=4.0))
    return DrafterTrainer(obj, TrainConfig(warmup_ratio=0.0, cuda_graph=graph), 10, None, CPU)


def test_the_trainer_says_why_its_step_is_launched():
    on, off = _trainer(True), _trainer(False)
    assert on.graph is None and on.describe_graph() == "off (no GPU)"
    assert off.graph is None and off.describe_graph() == "off (train.cuda_graph=false)"
    batch = synthetic_batch(128, 3 * 32, 256, "cpu", torch.float32, seed=0, lo=32, hi=64)
    on.train_step(batch)
    assert on.step == 1 and on.stats.steps == 1 and on.stats.valid_tokens == batch.num_valid_tokens > 0
    on.graph_why, on.graph = None, SimpleNamespace(failed=None)  # a GPU trainer's graph, its states
    assert on.describe_graph() == f"on (captured at this process's step {CAPTURE_AT}, replayed from then on)"
    on.graph.failed = "RuntimeError: boom"
    assert on.describe_graph() == "off (the capture failed: RuntimeError: boom; the steps run launched)"


def test_interval_sums_restart_in_place_and_what_was_popped_stays():
    """A captured step adds into the very tensors it recorded: reset zeroes them in place, and the
    popped sums are copies that the next interval does not change."""
    stats = IntervalStats(4, CPU)
    tensors = [stats.loss, stats.slot_correct, stats.blocks]
    correct = torch.tensor([[False, True, True, False], [False, True, False, True]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    stats.add(torch.tensor(2.5), correct, mask, torch.tensor(7))
    stats.count(100)
    out = stats.pop()
    assert [stats.loss, stats.slot_correct, stats.blocks] == tensors  # the same tensors, zeroed
    assert all(float(t.abs().sum()) == 0 for t in tensors) and stats.steps == 0 and stats.valid_tokens == 0
    stats.add(torch.tensor(1.0), correct, mask, torch.tensor(1))
    assert float(out["loss_sum"]) == 2.5 and float(out["ctx_keys"]) == 7 and out["steps"] == 1
    assert float(out["slot_correct_1"]) == 2 and float(out["slot_correct_3"]) == 1 and float(out["blocks"]) == 2
    assert out["valid_tokens"] == 100


class _Eager(StepGraph):
    """The trainer's graph path on CPU: `run` calls the body on the static inputs instead of
    capturing and replaying it (what a replay computes), so the host's bookkeeping around it is
    checked against launched steps."""

    def __init__(self):
        self.failed, self.steps, self.replays, self.graph = None, 0, 0, None

    def on_stream(self):
        return contextlib.nullcontext()

    def run(self, body, inputs, undo):
        if self.graph is None:  # the "capture": the graph's own input tensors
            self.graph = SimpleNamespace(static=[t.clone() for t in inputs])
        for s, t in zip(self.static, inputs):
            s.copy_(t)
        body(*self.static)
        self.replays += 1
        self.steps += 1
        return True


def test_the_graph_path_keeps_the_host_state_of_launched_steps():
    """Steps through the graph path (from step 3) give launched steps' weights, moments, interval
    sums, step counts and learning rates: nothing the capture would freeze is computed in its body.
    A batch of another length after the capture runs launched."""
    batches = [synthetic_batch(128, 3 * 32, 256, "cpu", torch.float32, seed=s, lo=32, hi=64) for s in range(3)]
    batches.append(synthetic_batch(96, 3 * 32, 256, "cpu", torch.float32, seed=3, lo=32, hi=64))
    order = [0, 1, 2, 0, 3, 1, 2]  # the 96-token batch comes after the capture
    runs = []
    for graph in (True, False):
        tr = _trainer(False)
        if graph:
            tr.graph = _Eager()
        torch.manual_seed(3)
        lrs = [tr.train_step(batches[i]) for i in order]
        if graph:
            assert tr.graph.replays == 4 and tr.graph.steps == 7  # steps 3, 4, 6, 7 replayed
        runs.append((lrs, tr.stats.pop(), tr.opt.named_master(), tr.step, float(tr.opt.step)))
    (lr1, s1, m1, n1, k1), (lr2, s2, m2, n2, k2) = runs
    assert tr.graph is None and lr1 == lr2 and n1 == n2 == 7 and k1 == k2 == 7.0
    assert len(set(lr1)) > 1  # the rate moves (warm-up + cosine): a frozen value would show
    for key, value in s2.items():
        assert float(s1[key]) == float(value), key
    for name in m1:
        assert torch.equal(m1[name], m2[name]), name
