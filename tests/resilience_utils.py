"""Helpers for the resilience tests: timed torchrun runs with injected faults and signals, and the
data each drafter step must consume (computed without any model, from the data streams alone)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from dflash_mp.config import compose
from dflash_mp.runtime import prepare
from dflash_mp.resilience import FAULT_ENV, batch_tally
from dflash_mp.topology import Topology

from e2e_utils import scalars

FAULT_RE = re.compile(r"FAULT (\w+): rank (\d+) at step (\d+) \(t=([\d.]+)\)")


def start(nproc: int, overrides: list[str], fault: str = "", extra_args: list[str] | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *(extra_args or []), "-m", "dflash_mp.main", *overrides]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout: float = 240) -> tuple[int, str, float]:
    """(returncode, combined output, time.time() at exit)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # the torchrun agent started by this test, by its own handle
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun still running after {timeout} s (a hang):\n{out[-6000:]}") from None
    return proc.returncode, out, time.time()


def run(nproc: int, overrides: list[str], fault: str = "", extra_args: list[str] | None = None,
        timeout: float = 240) -> tuple[int, str, float]:
    return finish(start(nproc, overrides, fault, extra_args), timeout)


def fault_time(out: str) -> float:
    m = FAULT_RE.search(out)
    assert m, f"the fault never fired:\n{out[-4000:]}"
    return float(m.group(4))


def expected_data(overrides: list[str], world: int, num_steps: int) -> dict[int, dict[str, float]]:
    """Per drafter step (1-based): docs/tokens/checksum of the batches all drafters consume."""
    from dflash_mp.data import build_stream

    job = compose(overrides)
    topo = Topology.plan(job.topology.num_target_ranks, 0, world, stages=job.target.stages)
    res = prepare(job)
    job, tokenizer, tcfg = res.job, res.tokenizer, res.target_config  # the job with real paths
    # One data shard per target replica, sent by its last stage (the replica's only rank with stages=1).
    streams = {rep[-1]: iter(build_stream(job.data, tokenizer, i, topo.num_replicas, vocab_limit=tcfg["vocab_size"]))
               for i, rep in enumerate(topo.replicas)}
    out = {}
    for step in range(num_steps):
        row = {"docs": 0.0, "tokens": 0.0, "checksum": 0.0}
        for t in streams:
            for _ in topo.sends_at_step(t, step):
                for k, v in batch_tally(next(streams[t])).items():
                    row[k] += v
        out[step + 1] = row
    return out


def consumed(run_dir: str) -> dict[int, dict[str, float]]:
    """Per logged step, what the drafters consumed; a restarted run appends, later rows win."""
    return {r["step"]: {k: r[f"data/{k}"] for k in ("docs", "tokens", "checksum")}
            for r in scalars(run_dir) if "data/docs" in r}


def worker_pids(agent_pid: int) -> list[int]:
    """The torchrun agent's live workers (its direct children with a RANK), in rank order: read from each
    one's environment, not assumed from the order the kernel lists the children in."""
    with open(f"/proc/{agent_pid}/task/{agent_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    ranks = {}
    for pid in children:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (FileNotFoundError, ProcessLookupError):  # reaped since the listing; exited, not yet reaped
            continue
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = pid
    return [ranks[r] for r in sorted(ranks)]


def signal_workers(agent_pid: int, sig=signal.SIGTERM) -> list[int]:
    pids = worker_pids(agent_pid)
    for pid in pids:  # only the workers of the agent this test started
        os.kill(pid, sig)
    return pids


# A rank's own error line, as main.setup_logging and resilience.fail_fast write it (not torchrun's
# summary, which repeats the exception text):
# "[HH:MM:SS D1 ERROR dflash_mp.resilience] drafter rank 1 failed: ..."
ERROR_RE = re.compile(r"^\[(\d\d):(\d\d):(\d\d) ([TD])(\d+) ERROR dflash_mp\.(?:resilience|liveness)\] "
                      r"(\w+ rank \d+(?: \(stage \d+ of \d+\))? failed: .*)$", re.MULTILINE)


def signal_when_logged(proc, log_path: str, text: str, before: str) -> tuple[int, str, float]:
    """SIGTERM every worker once `text` shows in `log_path`: the job's exit code, its output and the
    seconds from the signal to its end."""
    deadline = time.time() + 180
    while not (os.path.exists(log_path) and text in open(log_path).read()):
        assert proc.poll() is None and time.time() < deadline, f"the run ended before {before}"
        time.sleep(0.2)
    t0 = time.time()
    signal_workers(proc.pid)
    rc, out, end = finish(proc, timeout=120)
    return rc, out, end - t0


def rank_error(out: str, text: str) -> tuple[str, float]:
    """(message, seconds from the fault to it) of the first rank error line containing `text`.

    Log times are whole seconds (truncated), the fault's time is exact: the figure is up to 1 s
    below the true delay (so slightly negative for an error logged at once)."""
    for m in ERROR_RE.finditer(out):
        if text in m.group(6):
            t = fault_time(out)
            fault = time.localtime(t)
            fault_s = fault.tm_hour * 3600 + fault.tm_min * 60 + fault.tm_sec + t % 1
            logged_s = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3))
            return m.group(6), (logged_s - fault_s + 43200) % 86400 - 43200  # across midnight too
    raise AssertionError(f"no rank logged an error containing {text!r}:\n{out[-4000:]}")
