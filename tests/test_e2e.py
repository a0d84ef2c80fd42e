"""Tier 3: the real entry point under torchrun (gloo, fp32), checked against a one-process reference."""

import glob
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dflash_mp.config import compose
from dflash_mp.reference import reference_run

from e2e_utils import SMALL, losses, scalars, torchrun

pytestmark = pytest.mark.slow


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return (a - b).norm().item() <= rel * max(b.norm().item(), 1e-12)


# (1, 2) takes turns at the "GPU" (gpu_turns=on: the node's ranks on CPU) from the drafter's 4th step:
# turns change when work runs, never what it computes. The last case's targets forward two rows at a time
# (target.rows_per_forward=2), 3 rows each: the last forward's second row is a repeat, never sent.
@pytest.mark.parametrize("targets,world,turns,rows", [(1, 2, "on", 1), (1, 3, "auto", 1), (2, 3, "auto", 1),
                                                      (2, 3, "auto", 2)])
def test_split_trains_end_to_end_and_equals_one_process_reference(tmp_path, targets, world, turns, rows):
    run_dir = str(tmp_path / "run")
    ov = SMALL + [f"run_dir={run_dir}", f"topology.num_target_ranks={targets}", "train.max_steps=6",
                  f"topology.gpu_turns={turns}", f"target.rows_per_forward={rows}"]
    torchrun(world, ov)
    logged = open(f"{run_dir}/logs/rank_0.log").read()
    assert ("GPU turns on: ranks [0, 1] share the GPU" in logged) == (turns == "on")

    # Everything a user expects on disk.
    assert glob.glob(f"{run_dir}/tb/target/events.out.tfevents.*")
    assert glob.glob(f"{run_dir}/tb/drafter/events.out.tfevents.*")
    assert os.path.exists(f"{run_dir}/config.yaml")
    cfg = json.load(open(f"{run_dir}/export/config.json"))
    assert cfg["architectures"] == ["DFlashDraftModel"]
    rows = scalars(run_dir)
    tags = set().union(*rows)
    for tag in ("drafter/loss", "drafter/tau_sim", "drafter/lr", "drafter/grad_norm", "drafter/acc_slot_1",
                "throughput/samples_per_s", "throughput/tokens_per_s", "throughput/mfu", "comm/wait_ms",
                "compile/recompiles"):
        assert tag in tags, tag
    # Where each logged step's time went: the phases of the step fit in the interval's wall time.
    phases = ("time/fwd_bwd_ms", "time/allreduce_ms", "time/optimizer_ms")
    for r in rows:
        assert all(r[p] >= 0 for p in phases) and r["time/fwd_bwd_ms"] > 0
        step_ms = 1000 * (world - targets) / r["throughput/samples_per_s"]  # log_every=1: one step per row
        assert sum(r[p] for p in phases) <= step_ms
    assert all("time/logging_ms" in r for r in rows if r["step"] > 1)
    target_tags = set().union(*scalars(run_dir, "target"))
    assert {"target/tokens_per_s", "target/mfu", "comm/stall_ms", "comm/in_flight"} <= target_tags

    # The process split changes nothing: same per-step losses and final weights as one process.
    ref = reference_run(compose(ov), world)
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 7))
    for step, want in enumerate(ref["losses"], start=1):
        assert abs(got[step] - want) <= 1e-5 * abs(want), (step, got[step], want)
    final = torch.load(f"{run_dir}/checkpoints/step_00000006/drafter.pt", weights_only=False)["drafter"]
    for name, want in ref["state"].items():
        assert close(final[name], want), name
    exported = load_file(f"{run_dir}/export/model.safetensors")
    assert set(exported) == set(ref["state"])


def test_resume_continues_exactly_where_it_stopped(tmp_path):
    run_dir = str(tmp_path / "run")
    ov = SMALL + [f"run_dir={run_dir}", "topology.num_target_ranks=1", "train.max_steps=8", "checkpoint.every=4",
                  "checkpoint.keep=5"]
    torchrun(3, ov)
    first = losses(run_dir)
    assert first[8] < first[1], "loss did not fall"
    # Drop the final checkpoint and everything logged: resume=auto must pick step 4 and redo 5..8.
    shutil.rmtree(f"{run_dir}/checkpoints/step_00000008")
    shutil.rmtree(f"{run_dir}/tb")
    torchrun(3, ov + ["checkpoint.resume=auto"])
    second = losses(run_dir)
    assert sorted(second) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert abs(second[step] - first[step]) <= 1e-6 * abs(first[step]), step
