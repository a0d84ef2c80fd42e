"""Staged targets under torchrun (gloo, fp32, CPU): the same losses and weights as the one-process
reference, exact resume after a stage dies, and a frozen stage named within the bound."""

import json
import os
import re
import time

import pytest
import torch

from dflash_mp.config import compose
from dflash_mp.reference import reference_run

from e2e_utils import SMALL, losses, scalars, torchrun
from resilience_utils import (consumed, expected_data, fault_time, finish, rank_error, run, signal_workers,
                              start)

pytestmark = pytest.mark.slow


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return (a - b).norm().item() <= rel * max(b.norm().item(), 1e-12)


def check_against_reference(run_dir: str, ov: list[str], world: int, steps: int) -> None:
    ref = reference_run(compose(ov), world)
    got = losses(run_dir)  # log_every=1: every step's loss (a restart's rows replace the first attempt's)
    assert sorted(got) == list(range(1, steps + 1))
    for step, want in enumerate(ref["losses"], start=1):
        assert abs(got[step] - want) <= 1e-5 * abs(want), (step, got[step], want)
    final = torch.load(f"{run_dir}/checkpoints/step_{steps:08d}/drafter.pt", weights_only=False)["drafter"]
    for name, want in ref["state"].items():
        assert close(final[name], want), name


# stages, target ranks, world, transport: three stages over gloo p2p; two replicas of two stages over
# shm feeding one drafter in turns (each replica its own data shard). One replica of two stages over
# shm is the job of the crash and SIGTERM tests below, checked against the reference there too.
CASES = [(3, 3, 4, "p2p"), (2, 4, 5, "auto")]


@pytest.mark.parametrize("stages,targets,world,kind", CASES)
def test_staged_target_trains_exactly_like_the_one_process_reference(tmp_path, stages, targets, world, kind):
    run_dir = str(tmp_path / "run")
    ov = SMALL + [f"run_dir={run_dir}", f"target.stages={stages}", f"topology.num_target_ranks={targets}",
                  f"transport.kind={kind}", "train.max_steps=6"]
    proc = torchrun(world, ov)
    log = proc.stdout + proc.stderr
    assert f"target stages ({stages} per replica): stage 0: layers 0-" in log
    link = "shm" if kind == "auto" else "p2p"
    assert f"transport on rank 0 (node 0): 0->1 {link}" in log
    check_against_reference(run_dir, ov, world, 6)
    # The drafters consumed the replicas' data shards in the planned order.
    assert consumed(run_dir) == expected_data(ov, world, 6)
    rows = scalars(run_dir, "target")
    assert all(r["data/tokens"] > 0 for r in rows)  # counted once per replica (stage 0), not per stage
    assert any("comm/stage_wait_ms" in r for r in rows)


STEPS = 8
CRASH = SMALL + ["target.stages=2", "topology.num_target_ranks=2", f"train.max_steps={STEPS}", "checkpoint.every=2",
                 "checkpoint.keep=2", "transport.timeout_s=30", "topology.timeout_s=30", "train.stop_grace_s=10"]


def test_a_stage_killed_mid_run_restarts_and_matches_the_uninterrupted_run(tmp_path):
    run_dir = str(tmp_path / "run")
    ov = CRASH + [f"run_dir={run_dir}"]
    rc, out, _ = run(3, ov, fault="0:5:kill", extra_args=["--max-restarts=1"])
    assert rc == 0, out[-6000:]
    assert "FAULT kill: rank 0 at step 5" in out and "torchrun restart 1" in out
    resumed = int(re.search(r"resumed from .*step_(\d{8}) at step", out).group(1))
    assert resumed in (2, 4)  # the stages run ahead of the drafter
    check_against_reference(run_dir, ov, 3, STEPS)
    assert consumed(run_dir) == expected_data(ov, 3, STEPS)


TIMEOUT_S = 6


def test_a_frozen_stage_ends_every_rank_within_the_bound_naming_it(tmp_path):
    ov = SMALL + [f"run_dir={tmp_path}", "target.stages=2", "topology.num_target_ranks=2", "train.max_steps=12",
                  f"transport.timeout_s={TIMEOUT_S}", "topology.timeout_s=12", "train.stop_grace_s=5"]
    rc, out, end = run(3, ov, fault="0:3:hang")
    assert rc != 0
    took = end - fault_time(out)
    # Whichever wait runs out first (stage 1's on stage 0, or the drafter's on stage 1, which then
    # follows stage 1's wait), the error ends at the stage that holds everything up.
    msg, after = rank_error(out, "no data from target rank")
    assert re.match(r"(target rank 1 \(stage 1 of 2\)|drafter rank 2) failed: no data from target rank", msg), msg
    assert f"for {TIMEOUT_S} s" in msg and "it is alive: target rank 0 (stage 0 of 2) [training" in msg, msg
    # The watcher adds quiet time a 1 s tick at a time and log times are whole seconds: up to 2 s "early".
    assert TIMEOUT_S - 2.5 < after < TIMEOUT_S + 1.5, after
    assert took < TIMEOUT_S + 5, took


def test_sigterm_stops_a_staged_job_with_a_checkpoint_and_resume_finishes_it(tmp_path):
    run_dir = str(tmp_path / "run")
    ov = SMALL + [f"run_dir={run_dir}", "target.stages=2", "topology.num_target_ranks=2", "train.max_steps=16",
                  "checkpoint.every=0", "train.stop_grace_s=20"]
    proc = start(3, ov)
    jsonl = f"{run_dir}/tb/drafter/scalars.jsonl"
    deadline = time.time() + 120
    while not (os.path.exists(jsonl) and any(json.loads(x)["step"] >= 4 for x in open(jsonl))):
        assert proc.poll() is None and time.time() < deadline, "the run ended before the signal"
        time.sleep(0.2)
    signal_workers(proc.pid)
    rc, out, _ = finish(proc, timeout=60)
    assert rc == 0, out[-6000:]
    stopped = int(re.search(r"stopped at step (\d+) of 16 \(SIGTERM\)", out).group(1))
    assert 4 <= stopped < 16 and os.path.isdir(f"{run_dir}/checkpoints/step_{stopped:08d}")
    torchrun(3, ov + ["checkpoint.resume=auto"])
    check_against_reference(run_dir, ov, 3, 16)
    assert consumed(run_dir) == expected_data(ov, 3, 16)
