"""Nothing lost, nothing hangs: crashes restart and resume exactly, checkpoints stay atomic, dead or
silent peers end every rank within a bound, bad input fails early, SIGTERM stops cleanly."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from dflash_mp import checkpoint as ckpt
from dflash_mp.config import compose
from dflash_mp.runtime import prepare, validate
from dflash_mp.resilience import Fault, StopAgreement, effective_resume, fault_from_env

from dist_utils import run_ranks
from e2e_utils import SMALL, losses, scalars
from resilience_utils import (consumed, expected_data, fault_time, finish, rank_error, run, signal_when_logged,
                              signal_workers, start)

STEPS = 8
CRASH = SMALL + ["topology.num_target_ranks=1", f"train.max_steps={STEPS}", "checkpoint.every=2",
                 "checkpoint.keep=2", "transport.timeout_s=30", "topology.timeout_s=30", "train.stop_grace_s=10"]


def close(a, b, rel=1e-5):
    return (a - b).norm().item() <= rel * max(b.norm().item(), 1e-12)


# ------------------------------------------------------------------------------------ fast: units
def test_fault_spec_parses_and_is_off_after_a_restart(monkeypatch):
    assert Fault.parse("2:5") == Fault(2, 5, "kill")
    assert Fault.parse("0:3:hang") == Fault(0, 3, "hang")
    assert Fault.parse("") is None
    for bad in ("x", "1", "1:2:explode", "1:2:kill:4"):
        with pytest.raises(ValueError, match="DFLASH_MP_FAULT"):
            Fault.parse(bad)
    monkeypatch.setenv("DFLASH_MP_FAULT", "1:4:checkpoint")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert fault_from_env() == Fault(1, 4, "checkpoint")
    assert effective_resume("") == ""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fault_from_env() is None  # the restarted attempt must run clean
    assert effective_resume("") == "auto" and effective_resume("/some/step_00000002") == "auto"


@pytest.mark.parametrize("override,match", [
    ("target.layer_ids=[1,6]", r"target.layer_ids=\[1, 6\].*0\.\.5"),
    ("drafter.mask_token_id=100000", "mask_token_id=100000 is outside"),
    ("drafter.num_kv_heads=3", "not divisible by num_kv_heads=3"),
    ("data.seq_len=16 drafter.block_size=10", "shorter than two blocks"),
])
def test_target_contradicting_the_drafter_config_is_a_value_error(override, match):
    with pytest.raises(ValueError, match=match):
        prepare(compose(override.split()))


def test_tokens_outside_the_drafter_vocabulary_are_a_counted_skip():
    from dflash_mp.data import load_conversations, tokenize_dataset

    job = compose(["data.max_rows=40"])
    res = prepare(job)
    job, tok, tcfg = res.job, res.tokenizer, res.target_config  # the job with real paths
    assert validate(job, tcfg, tok)
    kept, skipped = tokenize_dataset(load_conversations(job.data), tok, job.data, tcfg["vocab_size"])
    assert len(kept) == 40 and not skipped  # roles.run_target passes the target's vocabulary
    limit = sorted(max(r) for r in kept["input_ids"])[20]  # a vocabulary that half the rows overflow
    kept, skipped = tokenize_dataset(load_conversations(job.data), tok, job.data, limit)
    assert skipped["token_out_of_vocab"] == 40 - len(kept) > 0


def write_ckpt(root, step, ranks=(1, 2), world=3):
    tmp = ckpt.tmp_dir(root, step)
    os.makedirs(tmp, exist_ok=True)
    ckpt.save_file({"w": torch.ones(2)}, os.path.join(tmp, "drafter.pt"))
    for r in ranks:
        ckpt.save_file({"cpu": torch.get_rng_state()}, os.path.join(tmp, f"rng_rank{r}.pt"))
    return ckpt.commit(root, step, {"num_steps": 8, "world_size": world}, keep=5)


def test_missing_or_corrupt_resume_checkpoint_fails_validation(tmp_path):
    root = str(tmp_path / "ck")
    path = write_ckpt(root, 4)
    assert ckpt.validate_resume(path, root, (1, 2), 3) == path
    assert ckpt.validate_resume("auto", root, (1, 2), 3) == path
    with pytest.raises(ValueError, match="does not exist"):
        ckpt.validate_resume(str(tmp_path / "nope"), root, (1, 2), 3)
    with pytest.raises(ValueError, match="3-rank job"):
        ckpt.validate_resume(path, root, (1, 2, 3), 4)
    with pytest.raises(ValueError, match="no rng_rank3.pt"):
        ckpt.validate_resume(path, root, (1, 2, 3), 3)
    with open(os.path.join(path, "drafter.pt"), "r+b") as f:  # torn: the zip directory is gone
        f.truncate(40)
    with pytest.raises(ValueError, match="drafter.pt is corrupt"):
        ckpt.validate_resume(path, root, (1, 2), 3)
    with open(os.path.join(path, ckpt.MANIFEST), "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match="corrupt manifest"):
        ckpt.validate_resume(path, root, (1, 2), 3)


def test_keep_prunes_old_checkpoints_and_torn_writes(tmp_path):
    root = str(tmp_path)
    for s in (2, 4, 6):
        write_ckpt(root, s)
    os.makedirs(ckpt.tmp_dir(root, 5))  # a write killed at step 5: older than the newest, pruned
    write_ckpt(root, 8)
    ckpt.prune(root, keep=2)
    assert sorted(os.listdir(root)) == ["step_00000006", "step_00000008"]


def _stop_agreement(rank, world, every, num_steps, signalled_rank, signal_at, targets):
    """Targets and drafters run their halves of the stop protocol; returns each one's stop step."""
    group = torch.distributed.new_group(list(range(world)), backend="gloo")

    class Flag:
        requested = False

    flag = Flag()
    agree = StopAgreement(flag, group, every, 0, num_steps)
    if rank < targets:
        for step in range(num_steps):
            if rank == signalled_rank and step >= signal_at:
                flag.requested = True
            if agree.target_before(step):
                agree.finish()
                return step
        agree.finish()
        return num_steps
    for step in range(num_steps):
        time.sleep(0.01)  # drafters lag the targets, as they do for real
        if rank == signalled_rank and step >= signal_at:
            flag.requested = True
        if agree.drafter_after(step + 1):
            return step + 1
    return num_steps


@pytest.mark.parametrize("signalled_rank,signal_at,want", [(0, 7, 12), (2, 3, 8), (2, 17, 20), (-1, 0, 20)])
def test_every_rank_agrees_on_the_same_stop_step(signalled_rank, signal_at, want):
    got = run_ranks(_stop_agreement, 3, 4, 20, signalled_rank, signal_at, 1, timeout=60)
    assert got == [want] * 3


def _sleep_after_sigterm(grace):
    from dflash_mp.resilience import StopSignal

    StopSignal(grace).install()
    print("ready", flush=True)
    while True:  # a rank stuck forever: only the watchdog ends it
        time.sleep(0.5)


def _signal_and_time(call: str, timeout: float = 30.0):
    """`t.<call>` of this module in a child process, SIGTERMed once it prints "ready": (exit code,
    stdout, stderr, seconds from the signal to the exit). A child still running at `timeout` is killed."""
    here = os.path.dirname(__file__)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_resilience as t; t.{call}"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=timeout)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=timeout)  # reads as it waits: a chatty child never blocks
        return proc.returncode, out, err, time.monotonic() - t0
    finally:
        proc.kill()


def test_sigterm_watchdog_ends_a_stuck_rank_after_the_grace_period():
    rc, _, err, took = _signal_and_time("_sleep_after_sigterm(1.0)", timeout=20)
    assert rc == 1 and took < 3.0, (rc, took, err)


def _protected_after_sigterm(grace, before_s, during_s):
    """A protected section of `before_s` before the signal (its duration lengthens the grace), then,
    after the signal, one of `during_s` (a checkpoint being written) that must not be cut short,
    then stuck: only the watchdog ends the process."""
    from dflash_mp.resilience import StopSignal

    stop = StopSignal(grace).install()
    if before_s:
        with stop.protect("a checkpoint"):
            time.sleep(before_s)
    print("ready", flush=True)
    stop.event.wait()
    if during_s:
        with stop.protect("the final checkpoint"):
            time.sleep(during_s)
        print("written", flush=True)
    while True:
        time.sleep(0.5)


def test_a_stop_never_cuts_a_checkpoint_short_and_its_time_lengthens_the_grace():
    # A 3 s write under way when the 1 s grace runs out: it finishes, then the grace (1 s + the 3 s
    # measured) counts from its end.
    rc, out, _, took = _signal_and_time("_protected_after_sigterm(1.0, 0, 3.0)")
    assert "written" in out and rc == 1 and 6.8 <= took < 10.0, (rc, out, took)
    # A 2 s checkpoint measured earlier: a stuck rank gets 1 + 2 s, not the bare 1 s.
    rc, out, _, took = _signal_and_time("_protected_after_sigterm(1.0, 2.0, 0)")
    assert rc == 1 and 2.8 <= took < 6.0, took


def _peer_checkpointing_after_sigterm(grace, peer_s):
    """Stuck after the signal while a peer (as liveness reports it) writes a checkpoint for `peer_s`."""
    from dflash_mp.resilience import StopSignal

    stop = StopSignal(grace).install()
    until = [float("inf")]  # busy from the signal until the main thread below sets the end
    stop.peers_busy = lambda: ["drafter rank 1 [checkpointing (step 6) for 3 s]"] if time.monotonic() < until[0] else []
    print("ready", flush=True)
    stop.event.wait()
    until[0] = time.monotonic() + peer_s
    while True:
        time.sleep(0.5)


def _stuck_before_any_step_after_sigterm(grace, store_gone=False):
    """Stuck after the signal while no drafter has finished a step: the grace ends it with exit 0,
    after telling its peers it is done (so that none of them reads its exit as a death).
    `store_gone`: telling them blocks, as a write to a store that no longer answers does."""
    from dflash_mp.resilience import StopSignal

    def tell():
        print("telling the peers", flush=True)
        if store_gone:
            time.sleep(3600)
        print("done, told the peers", flush=True)

    stop = StopSignal(grace).install()
    stop.none_trained = lambda: True
    stop.on_clean_exit = tell
    print("ready", flush=True)
    while True:
        time.sleep(0.5)


def test_a_stop_before_any_trained_step_ends_the_rank_with_zero_after_telling_its_peers():
    rc, out, err, took = _signal_and_time("_stuck_before_any_step_after_sigterm(1.0)")
    assert rc == 0 and 1.0 <= took < 4.0, (rc, took, err)
    assert "done, told the peers" in out and "nothing trained to save" in err, (out, err)


def test_a_clean_exit_does_not_wait_long_on_peers_it_cannot_reach():
    """The store gone with the agent: telling the peers blocks, and the rank still exits 0, a few
    seconds after its grace (CLEAN_EXIT_HOOK_S), not after the store's 60 s timeout."""
    from dflash_mp.resilience import CLEAN_EXIT_HOOK_S

    rc, out, err, took = _signal_and_time("_stuck_before_any_step_after_sigterm(1.0, store_gone=True)",
                                          timeout=20)
    assert rc == 0 and 1.0 + CLEAN_EXIT_HOOK_S <= took < 4.0 + CLEAN_EXIT_HOOK_S, (rc, took, err)
    assert "telling the peers" in out and "done, told" not in out, out
    assert f"tell did not return within {CLEAN_EXIT_HOOK_S:.0f} s" in err, err


def test_a_rank_outlives_its_grace_while_a_peer_writes_its_checkpoint():
    """A target waiting at the stop for its drafter's checkpoint is not cut off by its own grace, nor
    the moment the checkpoint ends: the stop still has steps to run, so the grace counts from there."""
    rc, _, err, took = _signal_and_time("_peer_checkpointing_after_sigterm(1.0, 4.0)")
    assert rc == 1 and 4.8 <= took < 8.0, (took, err)  # then stuck for real: the watchdog ends it
    assert "grace over, but drafter rank 1 [checkpointing" in err, err


# ----------------------------------------------------------------------- slow: real torchrun runs
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted job: the one-process reference (== torchrun, see test_e2e) and the data
    every drafter step must consume."""
    from dflash_mp.reference import reference_run

    ov = CRASH + [f"run_dir={tmp_path_factory.mktemp('ref')}"]
    ref = reference_run(compose(ov), 3)
    return ref, expected_data(ov, 3, STEPS)


def check_exact_resume(run_dir, out, ref, data, resumed_from, redone=False):
    assert f"resumed from {run_dir}/checkpoints/step_{resumed_from:08d} at step {resumed_from}" in out, out[-4000:]
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, want in enumerate(ref["losses"], start=1):
        assert abs(got[step] - want) <= 1e-5 * abs(want), (step, got[step], want)
    final = torch.load(f"{run_dir}/checkpoints/step_{STEPS:08d}/drafter.pt", weights_only=False)["drafter"]
    for name, want in ref["state"].items():
        assert close(final[name], want), name
    # Every batch of the plan consumed exactly once: per step, the same documents, tokens and
    # (token, position) checksum as the uninterrupted plan; nothing skipped, nothing repeated.
    seen = consumed(run_dir)
    assert seen == data
    assert sum(r["docs"] for r in seen.values()) == sum(r["docs"] for r in data.values())
    # Every step after the checkpoint was logged; a step the first attempt had already logged
    # (`redone`: the fault came after it) was logged again by the restart, with the same loss.
    rows = [r for r in scalars(run_dir) if r["step"] > resumed_from]
    assert {r["step"] for r in rows} == set(range(resumed_from + 1, STEPS + 1))
    if redone:
        assert len(rows) > STEPS - resumed_from
    for r in rows:
        want = ref["losses"][r["step"] - 1]
        assert abs(r["drafter/loss"] - want) <= 1e-5 * abs(want), (r["step"], r["drafter/loss"], want)


@pytest.mark.slow
def test_target_killed_mid_run_restarts_and_matches_the_uninterrupted_run(tmp_path, uninterrupted):
    ref, data = uninterrupted
    run_dir = str(tmp_path / "run")
    rc, out, _ = run(3, CRASH + [f"run_dir={run_dir}"], fault="0:5:kill", extra_args=["--max-restarts=1"])
    assert rc == 0, out[-6000:]
    assert "FAULT kill: rank 0 at step 5" in out and "torchrun restart 1" in out
    resumed = int(re.search(r"resumed from .*step_(\d{8}) at step", out).group(1))
    assert resumed in (2, 4)  # the target runs ahead: drafters had finished step 2 or 4
    check_exact_resume(run_dir, out, ref, data, resumed)


@pytest.mark.slow
def test_drafter_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, uninterrupted):
    ref, data = uninterrupted
    run_dir = str(tmp_path / "run")
    # Rank 1, the drafter leader, dies at step 4 after its rng file and before drafter.pt.
    rc, out, _ = run(3, CRASH + [f"run_dir={run_dir}"], fault="1:4:checkpoint", extra_args=["--max-restarts=1"])
    assert rc == 0, out[-6000:]
    assert "FAULT checkpoint: rank 1 at step 4" in out
    check_exact_resume(run_dir, out, ref, data, resumed_from=2, redone=True)
    assert sorted(os.listdir(f"{run_dir}/checkpoints")) == ["step_00000006", "step_00000008"]  # keep=2


TIMEOUT_S, GRACE_S = 6, 5
HANG = SMALL + ["train.max_steps=12", f"transport.timeout_s={TIMEOUT_S}", "topology.timeout_s=12",
                f"train.stop_grace_s={GRACE_S}"]
# README: "A dead or silent peer ends every rank within transport.timeout_s with a message naming it."
# The rank waiting on the peer fails with that message at timeout_s; every other rank's liveness
# watcher reads that failure at its next beat (1 s) and exits naming it. 5 s of slack for teardown
# on a loaded 2-core machine.
SILENT_END_S = TIMEOUT_S + 5


def run_failing(tmp_path, world: int, fault: str) -> tuple[str, float]:
    """A 1-target job that must fail after `fault`: (its output, seconds from the fault to its end)."""
    rc, out, end = run(world, HANG + [f"run_dir={tmp_path}", "topology.num_target_ranks=1"], fault=fault)
    took = end - fault_time(out)
    print(f"job ended {took:.1f} s after the fault")
    assert rc != 0
    return out, took


@pytest.mark.slow
def test_silent_target_ends_every_rank_within_the_transport_timeout(tmp_path):
    out, took = run_failing(tmp_path, 2, "0:3:hang")
    msg, after = rank_error(out, "no data from target rank 0")
    want = f"drafter rank 1 failed: no data from target rank 0 for {TIMEOUT_S} s"
    assert msg.startswith(want), msg
    # Not before the timeout, nor long after. The liveness watcher adds quiet time a tick (1 s) at a
    # time, so its first tick can count up to 1 s from before the wait began, and log times are
    # truncated to the second: the error can be logged up to 2 s "early" against the fault's exact time.
    assert TIMEOUT_S - 2.5 < after < TIMEOUT_S + 1.5, after
    assert took < SILENT_END_S, took


@pytest.mark.slow
def test_drafter_that_stops_receiving_ends_every_rank_within_the_bound(tmp_path):
    # Rank 2 hangs: the target waits for its credit, drafter 1 waits in the gradient all-reduce.
    out, took = run_failing(tmp_path, 3, "2:3:hang")
    msg, after = rank_error(out, "no credit from drafter rank 2")
    want = f"target rank 0 failed: no credit from drafter rank 2 for {TIMEOUT_S} s"
    assert msg.startswith(want), msg
    assert TIMEOUT_S - 2.5 < after < TIMEOUT_S + 1.5, after  # as above
    assert took < SILENT_END_S, took  # well before the process-group timeout (12 s + teardown)


@pytest.mark.slow
def test_dead_drafter_without_restart_ends_the_job_promptly(tmp_path):
    # A dead peer is seen at once (its pid is gone), long before transport.timeout_s.
    out, took = run_failing(tmp_path, 2, "1:3:kill")
    msg, after = rank_error(out, "died")
    assert msg.startswith("target rank 0 failed: drafter rank 1 ["), msg  # named by the watcher
    assert re.search(r"died \(pid \d+ is gone\)", msg), msg
    assert after < TIMEOUT_S, after
    assert took < TIMEOUT_S, took  # measured 0.8 s


@pytest.mark.slow
def test_bad_target_layer_ids_fail_before_any_process_group(tmp_path):
    t0 = time.time()
    rc, out, end = run(2, SMALL + [f"run_dir={tmp_path}", "target.layer_ids=[1,9]"], timeout=120)
    assert rc != 0
    assert "target.layer_ids=[1, 9]: ids must be distinct and in 0..5" in out, out[-4000:]
    assert "topology:" not in out  # rank 0 logs the topology right after the groups exist
    assert end - t0 < 60


def demo_with_bad_rows(path):
    from dflash_mp.data.chat import load_conversations  # noqa: F401 - the demo file is the package's

    src = os.path.join(os.path.dirname(__import__("dflash_mp").__file__), "assets", "demo_chat.jsonl")
    rows = open(src).read().splitlines()[:120]
    bad = ["{not json", json.dumps({"messages": []}), json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
           json.dumps({"other": 1})]
    with open(path, "w") as f:
        f.write("\n".join(rows[:60] + bad + rows[60:]) + "\n")


@pytest.mark.slow
def test_sigterm_checkpoints_exits_zero_and_resume_continues(tmp_path):
    data = str(tmp_path / "chat.jsonl")
    demo_with_bad_rows(data)
    run_dir = str(tmp_path / "run")
    ov = SMALL + [f"run_dir={run_dir}", f"data.path={data}", "data.max_rows=0", "topology.num_target_ranks=1",
                  "train.max_steps=24", "logging.log_every=2", "checkpoint.every=0", "train.stop_grace_s=20"]
    proc = start(3, ov)
    jsonl = f"{run_dir}/tb/drafter/scalars.jsonl"
    deadline = time.time() + 120
    while not (os.path.exists(jsonl) and any(json.loads(x)["step"] >= 4 for x in open(jsonl))):
        assert proc.poll() is None and time.time() < deadline, "the run ended before the signal"
        time.sleep(0.2)
    t0 = time.time()
    signal_workers(proc.pid)  # Slurm signals every process of the step
    rc, out, end = finish(proc, timeout=60)
    assert rc == 0, out[-6000:]
    print(f"stopped {end - t0:.1f} s after SIGTERM")
    assert end - t0 < 20, end - t0  # within train.stop_grace_s
    stopped = int(re.search(r"stopped at step (\d+) of 24 \(SIGTERM\)", out).group(1))
    assert 4 < stopped < 24 and stopped % 2 == 0
    assert ckpt.resolve_resume("auto", f"{run_dir}/checkpoints").endswith(f"step_{stopped:08d}")
    assert not os.path.exists(f"{run_dir}/export")  # only a finished run exports
    # Skipped rows: visible in TensorBoard (target writer) and at exit.
    trow = scalars(run_dir, "target")[-1]
    assert trow["data/skipped_invalid_json"] == 1 and trow["data/skipped_empty"] == 1
    assert trow["data/skipped_no_assistant"] == 1 and trow["data/skipped_missing_field"] == 1
    assert "data set: 4 rows skipped" in out

    rc, out, _ = run(3, ov + ["checkpoint.resume=auto"])
    assert rc == 0, out[-6000:]
    assert f"at step {stopped}" in out
    seen = consumed(run_dir)
    want = expected_data(ov, 3, 24)
    for step in range(2, 25, 2):  # rows cover two steps each
        assert seen[step] == {k: want[step - 1][k] + want[step][k] for k in want[step]}, step
    assert os.path.exists(f"{run_dir}/export/model.safetensors")


@pytest.mark.slow
def test_sigterm_during_a_slow_final_checkpoint_waits_for_it_and_exits_zero(tmp_path):
    """The final checkpoint's write takes 8 s (fault hook), far past train.stop_grace_s=2: SIGTERM
    in the middle of it still ends with that checkpoint complete, the export written and exit 0."""
    run_dir = str(tmp_path / "run")
    ov = SMALL + [f"run_dir={run_dir}", "topology.num_target_ranks=1", "train.max_steps=6", "logging.log_every=2",
                  "checkpoint.every=2", "train.stop_grace_s=2"]
    proc = start(3, ov, fault="1:6:slow_checkpoint")  # rank 1: the drafter leader, the final step's write
    rc, out, took = signal_when_logged(proc, f"{run_dir}/logs/rank_1.log", "FAULT slow_checkpoint",
                                       "its final checkpoint")
    assert rc == 0, out[-6000:]
    assert took > 2, "exited before the write could finish"
    assert ckpt.resolve_resume("auto", f"{run_dir}/checkpoints").endswith("step_00000006")
    assert os.path.exists(f"{run_dir}/export/model.safetensors")
    assert "did not stop within" not in out


@pytest.mark.slow
def test_sigterm_while_a_drafter_checkpoint_holds_the_target_up_still_exits_zero(tmp_path):
    """The stop lands a few steps after the signal, and on its way the drafter's checkpoint at step 6
    waits 8 s for the write of step 4 (fault hook): the target, blocked on the drafter meanwhile, outlives
    its own 2 s grace while liveness shows the drafter checkpointing, and every rank exits 0."""
    run_dir = str(tmp_path / "run")
    ov = SMALL + [f"run_dir={run_dir}", "topology.num_target_ranks=1", "train.max_steps=12", "logging.log_every=2",
                  "checkpoint.every=2", "train.stop_grace_s=2"]
    proc = start(3, ov, fault="1:4:slow_checkpoint")
    rc, out, _ = signal_when_logged(proc, f"{run_dir}/logs/rank_1.log", "FAULT slow_checkpoint",
                                    "its step-4 checkpoint")
    assert rc == 0, out[-6000:]
    assert "did not stop within" not in out
    assert "grace over, but drafter rank" in out, out[-6000:]
    newest = ckpt.resolve_resume("auto", f"{run_dir}/checkpoints")
    assert int(newest.rsplit("_", 1)[1]) >= 6 and "stopped at step" in out


@pytest.mark.slow
def test_sigterm_while_the_first_step_compiles_exits_zero_with_nothing_to_save(tmp_path, monkeypatch):
    """A preemption while the drafters still compile their first step (held 30 s by a test hook, as
    a cold node's compile is): the stop cannot land before the compile ends, so the grace (3 s) ends
    every rank, with exit 0 and saying why: no step was trained, nothing is lost."""
    monkeypatch.setenv("DFLASH_MP_SLOW_COMPILE_S", "30")
    run_dir = str(tmp_path / "run")
    ov = SMALL + [f"run_dir={run_dir}", "topology.num_target_ranks=1", "train.max_steps=12",
                  "logging.log_every=2", "checkpoint.every=2", "train.stop_grace_s=3"]
    proc = start(3, ov)
    rc, out, took = signal_when_logged(proc, f"{run_dir}/logs/rank_1.log", "first step held",
                                       "its first step")
    assert rc == 0, out[-6000:]
    assert 3 <= took < 20, took  # the grace, not the 30 s compile
    assert out.count("before any drafter finished a step of this attempt") == 3, out[-6000:]
    ckdir = f"{run_dir}/checkpoints"
    assert not os.path.isdir(ckdir) or not os.listdir(ckdir)  # the stop wrote nothing: nothing was trained
    assert "died" not in out, out[-6000:]  # a rank that exits 0 first is done to its peers, not dead


@pytest.mark.slow
def test_sigterm_after_trained_steps_with_a_hung_drafter_still_fails(tmp_path):
    """The other side of the start-up rule: a drafter hangs at step 3 (fault hook), three steps
    trained and none saved; the stop cannot land, the grace ends the ranks, and the job fails."""
    run_dir = str(tmp_path / "run")
    ov = SMALL + [f"run_dir={run_dir}", "topology.num_target_ranks=1", "train.max_steps=12",
                  "logging.log_every=2", "checkpoint.every=0", "train.stop_grace_s=2"]
    proc = start(3, ov, fault="2:3:hang")
    rc, out, _ = signal_when_logged(proc, f"{run_dir}/logs/rank_2.log", "FAULT hang", "its hang")
    assert rc != 0, out[-6000:]
    assert "did not stop within" in out and "nothing trained to save" not in out, out[-6000:]


@pytest.mark.slow
def test_a_rank_that_stalls_once_leaves_the_job_unchanged_and_its_peer_waits_it_out(tmp_path):
    """The target, then (another run) the drafter, pauses 1 s at step 3 (fault hook) while the ranks
    take turns at the "GPU". A stalled target empties the ring: the drafter waits that second for its
    batch. A stalled drafter leaves the target waiting for credit while its ring stays full: the
    drafter never waits. Both jobs end normally, with every step's loss the one the job computes
    without a pause."""
    ov = SMALL + ["topology.num_target_ranks=1", "train.max_steps=6", "logging.log_every=1",
                  "topology.gpu_turns=on"]
    runs = {}
    for name, fault in (("plain", ""), ("target", "0:3:stall"), ("drafter", "1:3:stall")):
        run_dir = str(tmp_path / name)
        rc, out, _ = run(2, ov + [f"run_dir={run_dir}"], fault=fault)
        assert rc == 0, out[-6000:]
        runs[name] = run_dir
    assert "FAULT stall: rank 0 at step 3" in open(f"{runs['target']}/logs/rank_0.log").read()
    assert "FAULT stall: rank 1 at step 3" in open(f"{runs['drafter']}/logs/rank_1.log").read()
    waits = {r["step"]: r["comm/wait_ms"] for r in scalars(runs["target"])}
    assert waits[4] > 200, waits  # the 0-based step 3 is logged as step 4; ~980 ms here
    assert max(waits[s] for s in (2, 3, 5, 6)) < 100, waits  # ~0.1 ms here
    waits = {r["step"]: r["comm/wait_ms"] for r in scalars(runs["drafter"])}
    assert max(waits[s] for s in range(2, 7)) < 100, waits
    stalls = {name: sum(r["comm/stall_ms"] for r in scalars(runs[name], "target")) for name in runs}
    assert stalls["drafter"] - stalls["plain"] > 500, stalls  # the target waited out the drafter's second
    for name in ("target", "drafter"):
        assert losses(runs[name]) == losses(runs["plain"]), name
