"""Busy is not dead: a peer that compiles for longer than transport.timeout_s is waited for; a frozen,
dead or stuck peer ends every rank within its bound, named by every survivor."""

import glob
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from torch.distributed import HashStore

from dflash_mp.liveness import DONE, FAILED, Liveness, LivenessConfig
from dflash_mp.transport.shm import PREFIX

from e2e_utils import SMALL
from resilience_utils import finish, start, worker_pids

NAMES = {0: "target rank 0", 1: "drafter rank 1", 2: "drafter rank 2"}


class DictStore:
    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v

    def get(self, k):
        return self.d[k]


class UnansweredSetStore(DictStore):
    """A TCPStore client as its server sees it: a set is sent and not answered, so it lands in the store
    (`landed`, what other clients read) only once a later request of this client has been answered."""

    def __init__(self):
        super().__init__()
        self.landed = {}

    def get(self, k):
        self.landed.update(self.d)
        return self.d[k]


def beat(n, phase="training", age=1.0, step=5, wait=None, reason="", pid=None, host="elsewhere"):
    return {"n": n, "host": host, "pid": pid or 1, "phase": phase, "detail": "", "age": age, "step": step,
            "reason": reason, "wait": wait}


def watcher(stale=6.0, wait=6.0, store=None, **bounds):
    return Liveness(store or DictStore(), 1, 3, NAMES, LivenessConfig(stale_s=stale, **bounds), wait_s=wait,
                    exit_fn=lambda code: None)


def exited_pid() -> int:
    """The pid of a process of this host that has already exited."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------ fast: the rules
def test_done_returns_once_the_watcher_has_left_the_store():
    """A rank that ends cleanly leaves no thread inside a store call: done() waits for the watcher's
    read under way (here one that takes 0.3 s a key) to end, and the watcher then stops."""
    import threading
    import time

    inside = threading.Event()

    class SlowStore(DictStore):
        def check(self, keys):
            inside.set()
            time.sleep(0.3)
            return False

    live = Liveness(SlowStore(), 1, 3, NAMES, LivenessConfig(stale_s=6.0, interval_s=0.05), wait_s=6.0,
                    exit_fn=lambda code: None).start()
    assert inside.wait(5.0)
    t0 = time.monotonic()
    live.done()
    assert not live._thread.is_alive() and time.monotonic() - t0 < 3.0


def test_the_last_beat_of_a_failed_or_finished_rank_has_landed_before_it_returns():
    """A rank that fails (or finishes) exits right after its last beat: its peers may see its pid gone at
    once. That beat must be in the store by then, or a survivor names the rank dead instead of quoting
    why it failed (the suite saw drafter rank 2 blame drafter rank 1, which had named the frozen target)."""
    for end, phase in ((lambda w: w.failed("drafter rank 1 failed: target rank 0 is frozen"), FAILED),
                       (lambda w: w.done(), DONE)):
        store = UnansweredSetStore()
        w = Liveness(store, 1, 3, NAMES, LivenessConfig(stale_s=6.0), wait_s=6.0, exit_fn=lambda code: None)
        end(w)
        assert json.loads(store.landed["hb/1"])["phase"] == phase, store.landed


def test_a_beat_that_stops_moving_is_dead_after_the_stale_bound_and_named():
    w = watcher(stale=6.0)
    t = 100.0
    for i in range(8):  # rank 0 stops beating at n=3; rank 2 keeps going
        assert w.check({0: beat(min(i, 3)), 1: None, 2: beat(i)}, t + i, 1.0) is None
    problem = w.check({0: beat(3), 1: None, 2: beat(9)}, t + 10.2, 1.0)
    assert problem.startswith("target rank 0 [training for 1 s, step 5] has not beaten for 7 s"), problem
    assert "dead or frozen" in problem


def test_a_peer_in_a_busy_phase_over_its_bound_is_stuck_and_the_setting_is_named():
    w = watcher(compiling_s=300.0)
    assert w.check({0: beat(1, "compiling", age=299), 1: None, 2: beat(1)}, 0.0, 1.0) is None
    problem = w.check({0: beat(2, "compiling", age=301), 1: None, 2: beat(2)}, 1.0, 1.0)
    assert "target rank 0 [compiling for 301 s" in problem and "liveness.compiling_s=300" in problem


def test_a_failed_peer_is_quoted_and_a_finished_one_is_never_stale():
    w = watcher(stale=2.0)
    reason = "drafter rank 2 failed: RuntimeError: boom"
    assert w.check({0: beat(1, DONE), 1: None, 2: beat(1, FAILED, reason=reason)}, 0.0, 1.0) == reason
    w = watcher(stale=2.0)
    for i in range(10):  # a done rank stops beating: fine
        assert w.check({0: beat(1, DONE), 1: None, 2: beat(i)}, float(i), 1.0) is None


def test_no_drafter_has_trained_until_one_finishes_the_first_step_of_its_attempt():
    """What lets a stop during start-up exit 0 (resilience.StopSignal.none_trained)."""
    w, drafters = watcher(), [1, 2]  # this rank is drafter 1; rank 0 is the target
    assert w.none_trained(drafters)  # before any step, no beat read yet
    w._beats = {0: {**beat(1, step=9), "trained": True},  # the target (a flag it never sets)
                2: {**beat(1, "compiling", step=4), "trained": False}}
    w.step(4)
    assert w.none_trained(drafters)  # the target does not count; both drafters inside their first step
    w.trained()
    assert not w.none_trained(drafters)  # this rank finished it
    w = watcher()
    w._beats = {2: {**beat(2, step=5), "trained": True}}
    assert not w.none_trained(drafters)  # the other drafter did
    assert w._payload()["trained"] is False  # what this rank tells the others


def test_a_dead_pid_on_this_host_is_named_at_once():
    pid = exited_pid()
    problem = watcher().check({0: beat(1, pid=pid, host=socket.gethostname()), 1: None, 2: beat(1)}, 0.0, 1.0)
    assert problem and problem.startswith("target rank 0") and f"died (pid {pid} is gone)" in problem


def test_a_dead_rank_is_named_before_a_failure_that_was_its_consequence_and_a_root_failure_before_both():
    """Drafter rank 2 is killed. Target rank 0's collective breaks first and its watcher has not named
    rank 2 by the end of settle() (a loaded machine): it writes the broken connection as its reason,
    marked a consequence. A survivor names the dead rank 2, not rank 0's connection error; with no dead
    or stuck rank in sight it quotes rank 0. A rank's own failure comes before both, whatever its rank:
    the rank that torchrun's teardown ended after it is not the cause."""
    pid, here = exited_pid(), socket.gethostname()
    broken = "target rank 0 failed: RuntimeError: Connection reset by peer"
    relayed = beat(3, FAILED, reason=broken, pid=pid, host=here) | {"consequence": True}
    problem = watcher().check({0: relayed, 1: None, 2: beat(2, pid=pid, host=here)}, 0.0, 1.0)
    assert problem.startswith("drafter rank 2 [training") and f"died (pid {pid} is gone)" in problem, problem
    assert watcher().check({0: relayed, 1: None, 2: beat(2)}, 0.0, 1.0) == broken
    own = "drafter rank 2 failed: ValueError: a bad batch"
    for first in (relayed, beat(2, pid=pid, host=here)):
        assert watcher().check({0: first, 1: None, 2: beat(3, FAILED, reason=own)}, 0.0, 1.0) == own


def test_a_peer_that_failed_or_finished_and_exited_after_the_read_is_quoted_not_called_dead():
    """The watcher read rank 0 training; rank 0 then wrote its failure (or DONE) and exited, so its pid
    is gone when check() looks. The watcher's verdict (`problem`) reads the beats again: it quotes rank
    0's reason, the first failure, as every survivor must, and lets a finished rank be. On a loaded
    machine this ordering made drafter rank 1 say "target rank 0 died" where the target had named the
    frozen drafter rank 2."""
    pid, here = exited_pid(), socket.gethostname()
    read_before = {0: beat(1, pid=pid, host=here), 1: None, 2: beat(1)}
    reason = "target rank 0 failed: drafter rank 2 [training for 0 s] has not beaten for 5 s: dead or frozen"
    for now_in_store, expected in ((beat(2, FAILED, reason=reason, pid=pid, host=here), reason),
                                   (beat(2, DONE, pid=pid, host=here), None),
                                   (read_before[0], f"died (pid {pid} is gone)")):  # nothing new: it stands
        store = HashStore()
        for r, b in {0: now_in_store, 2: beat(2)}.items():
            store.set(f"hb/{r}", json.dumps(b))
        w = watcher(store=store)
        assert f"died (pid {pid} is gone)" in w.check(read_before, 0.0, 1.0)  # the old read alone
        verdict = w.problem(read_before, 1.0, 1.0)
        assert verdict is None if expected is None else expected in verdict, verdict


def test_a_wait_times_out_only_over_quiet_time_and_says_why_it_waited(caplog):
    w = watcher(wait=6.0)
    w.phase("training")
    with w.waiting(0, "batch 3", "no data from target rank 0 for 6 s (drafter rank 1 waiting for batch 3)"):
        t = time.monotonic()  # the wait started now; the checks below pretend i seconds passed
        with caplog.at_level(logging.INFO, logger="dflash_mp.liveness"):
            for i in range(20):  # rank 2 compiles for 20 s: the wait's clock stands still
                assert w.check({0: beat(i), 1: None, 2: beat(i, "compiling", age=i)}, t + i, 1.0) is None
        assert "not an error while busy: drafter rank 2 [compiling" in caplog.text
        for i in range(20, 26):
            assert w.check({0: beat(i), 1: None, 2: beat(i)}, t + i, 1.0) is None
        problem = w.check({0: beat(26), 1: None, 2: beat(26)}, t + 26, 1.0)
    assert problem.startswith("no data from target rank 0 for 6 s"), problem
    assert "it is alive: target rank 0 [training" in problem


def test_a_wait_that_runs_out_as_a_rank_freezes_names_it_frozen_a_tick_later():
    """Drafter rank 1 has waited for a collective of every rank since before target rank 0 froze, so its
    quiet time runs out when rank 0's beat is one interval late: one tick later the beat is two intervals
    late and rank 0 is named dead or frozen, not as the rank furthest behind of live ones."""
    w = watcher(wait=6.0)  # interval 1 s
    w.phase("training")
    with w.waiting(-1, "the stop agreement after step 5"):
        t = time.monotonic()
        for i in range(6):
            assert w.check({0: beat(i, step=1), 1: None, 2: beat(i)}, t + i, 1.0) is None
        assert w.check({0: beat(5, step=1), 1: None, 2: beat(6)}, t + 6, 1.0) is None  # quiet 7 s, 1 beat late
        problem = w.check({0: beat(5, step=1), 1: None, 2: beat(7)}, t + 7, 1.0)
    assert problem.startswith("target rank 0 [training") and "has not beaten for 2 s" in problem, problem
    assert problem.endswith("waited 8 s for the stop agreement after step 5: dead or frozen"), problem
    w = watcher(wait=6.0)  # past two intervals over the bound a late beat holds nothing up
    w.phase("training")
    with w.waiting(-1, "the stop agreement after step 5"):
        t = time.monotonic()
        for i in range(6):
            assert w.check({0: beat(i, step=1), 1: None, 2: beat(i)}, t + i, 1.0) is None
        problem = w.check({0: beat(5, step=1), 1: None, 2: beat(6)}, t + 6, 3.0)  # quiet 9 s, 1 beat late
    assert "waited 9 s" in problem and "furthest behind: target rank 0" in problem, problem


def staged_watcher(wait=6.0):
    """Drafter rank 2 of a 2-stage target (ranks 0 -> 1 -> 2)."""
    names = {0: "target rank 0 (stage 0 of 2)", 1: "target rank 1 (stage 1 of 2)", 2: "drafter rank 2"}
    return Liveness(DictStore(), 2, 3, names, LivenessConfig(stale_s=60.0), wait_s=wait, exit_fn=lambda code: None)


def test_a_wait_that_runs_out_follows_the_peers_wait_to_the_stage_that_holds_everything_up():
    w = staged_watcher()
    w.phase("training")
    waits_on_0 = {"peer": 0, "what": "batch 3", "for": 4.0}
    with w.waiting(1, "batch 3", "no data from target rank 1 (stage 1 of 2) for 6 s"):
        t = time.monotonic()
        for i in range(7):  # stage 0 keeps beating (alive) but sends nothing: stage 1 waits for it
            problem = w.check({0: beat(i), 1: beat(i, wait=waits_on_0), 2: None}, t + i, 1.0)
    assert problem == ("no data from target rank 1 (stage 1 of 2) for 6 s; target rank 1 (stage 1 of 2) waits "
                       "for batch 3 from target rank 0 (stage 0 of 2); it is alive: target rank 0 (stage 0 of 2) "
                       "[training for 1 s, step 5] (transport.timeout_s=6)"), problem
    # Stage 0 frozen (its beat stopped): named dead or frozen at the end of the chain.
    w = staged_watcher()
    w.phase("training")
    with w.waiting(1, "batch 3", "no data from target rank 1 (stage 1 of 2) for 6 s"):
        t = time.monotonic()
        for i in range(7):
            problem = w.check({0: beat(1), 1: beat(i, wait=waits_on_0), 2: None}, t + i, 1.0)
    assert "waits for batch 3 from target rank 0 (stage 0 of 2), which has not beaten for 6 s: dead or " \
           "frozen: target rank 0 (stage 0 of 2) [training" in problem, problem


# ------------------------------------------------------------------------ slow: real torchrun jobs
LIVE = SMALL + ["train.max_steps=8", "transport.timeout_s=5", "topology.timeout_s=300", "train.stop_grace_s=5",
                "topology.num_target_ranks=1", "checkpoint.every=0"]


@pytest.mark.slow
def test_a_drafter_compiling_three_times_the_timeout_is_busy_not_dead(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MP_SLOW_COMPILE_S", "15")  # 3 x transport.timeout_s
    rc, out, _ = finish(start(3, LIVE + [f"run_dir={tmp_path}"]), timeout=240)
    assert rc == 0, out[-6000:]
    assert "first step held for 15 s" in out
    assert "not an error while busy: drafter rank" in out, out[-4000:]
    assert os.path.isfile(tmp_path / "export" / "model.safetensors")


def _shm_of(pids) -> list[str]:
    return [p for pid in pids for p in glob.glob(f"/dev/shm/{PREFIX}{pid}_*")]


def _freeze_and_time_the_others(tmp_path, frozen_rank: int, world: int = 3):
    """Freeze `frozen_rank` (SIGSTOP) after the first logged steps; seconds until every other worker
    has exited, and the job's output."""
    proc = start(world, LIVE + [f"run_dir={tmp_path}", "train.max_steps=400"])
    scal = tmp_path / "tb" / "drafter" / "scalars.jsonl"
    deadline = time.time() + 180
    while not (scal.exists() and scal.stat().st_size > 0):
        assert proc.poll() is None and time.time() < deadline, "the job ended or never logged"
        time.sleep(0.2)
    pids = worker_pids(proc.pid)
    os.kill(pids[frozen_rank], signal.SIGSTOP)
    t0 = time.time()
    others = [p for i, p in enumerate(pids) if i != frozen_rank]
    while any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in others):
        if time.time() - t0 > 60:
            break
        time.sleep(0.2)
    took = time.time() - t0
    os.kill(pids[frozen_rank], signal.SIGKILL)  # let the agent finish now
    os.kill(pids[frozen_rank], signal.SIGCONT)
    rc, out, _ = finish(proc, timeout=120)
    return took, rc, out, pids


@pytest.mark.slow
@pytest.mark.parametrize("frozen_rank,name", [(0, "target rank 0"), (2, "drafter rank 2")])
def test_a_frozen_rank_ends_every_other_rank_within_the_bound_naming_it(tmp_path, frozen_rank, name):
    took, rc, out, pids = _freeze_and_time_the_others(tmp_path, frozen_rank)
    print(f"other ranks gone {took:.1f} s after SIGSTOP of rank {frozen_rank}")
    assert rc != 0
    assert took < 5 + 10, (took, out[-4000:])
    survivors = [r for r in range(3) if r != frozen_rank]
    for r in survivors:  # every survivor names the frozen rank in its own words
        role = "target" if r == 0 else "drafter"
        lines = [ln for ln in out.splitlines() if f"{role} rank {r} failed" in ln]
        assert any(name in ln and ("dead or frozen" in ln or "no data" in ln or "no credit" in ln)
                   for ln in lines), (r, out[-4000:])
    assert _shm_of(pids) == []


@pytest.mark.slow
def test_a_killed_drafter_is_named_by_every_survivor(tmp_path):
    # kill -9 drafter rank 2 mid-run: the target and drafter 1 both name rank 2, not the channel or
    # collective that happened to close first.
    proc = start(3, LIVE + [f"run_dir={tmp_path}", "train.max_steps=40"], fault="2:4:kill")
    rc, out, _ = finish(proc, timeout=120)
    assert rc != 0
    for who in ("target rank 0", "drafter rank 1"):
        lines = [ln for ln in out.splitlines() if f"{who} failed" in ln]
        assert any("drafter rank 2" in ln and "died" in ln for ln in lines), (who, out[-4000:])
