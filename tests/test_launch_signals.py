"""Stopping a job from outside: a scheduler's SIGTERM to the launcher alone, or Ctrl-C at the console,
ends the job with a checkpoint and exit code 0 (launch/single_node.sh passes the signal to the workers,
which agree on a stop step; torchrun signalled itself would tear them down and exit 1)."""

import os
import signal
import subprocess
import time

import pytest

from e2e_utils import SMALL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _terminal_signals() -> None:
    """In the child before exec: SIGINT and SIGTERM at their defaults and not blocked."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl_c_at_the_console", "sigterm_to_the_launcher"])
def test_the_launcher_stops_with_a_checkpoint_and_exit_code_zero(tmp_path, how):
    run_dir = tmp_path / "run"
    cmd = ["bash", os.path.join(ROOT, "launch", "single_node.sh"), f"run_dir={run_dir}", *SMALL,
           "train.max_steps=400", "logging.log_every=2", "checkpoint.every=0", "topology.num_target_ranks=1"]
    env = {**os.environ, "NPROC": "3", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    # A session of its own, as a terminal gives a job: Ctrl-C reaches its whole foreground group. The
    # signals as a terminal's job has them, whatever this process inherited: a shell started with SIGINT
    # ignored cannot trap it (as `cmd &` in a script has it), and the job would then run to its end.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, preexec_fn=_terminal_signals)
    scal = run_dir / "tb" / "drafter" / "scalars.jsonl"
    deadline = time.time() + 180
    while not (scal.exists() and scal.stat().st_size > 0):
        assert proc.poll() is None and time.time() < deadline, "the job ended or never logged"
        time.sleep(0.2)
    if how == "ctrl_c_at_the_console":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-5000:]
    assert "stopping at the next agreed step with a checkpoint" in out
    assert "KeyboardInterrupt" not in out and "Traceback" not in out, out[-5000:]
    ckpts = os.listdir(run_dir / "checkpoints")
    assert len(ckpts) == 1 and ckpts[0].startswith("step_"), ckpts
    assert not (run_dir / "export").exists()  # stopped early: no export
