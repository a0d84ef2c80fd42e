"""A run directory is owned by one run and nothing in it is lost; every error names the setting to fix.

One test (or group) per case of the issue: a fresh run into a used run_dir (1), two jobs in one
run_dir (2), all rows rejected / empty data (3), path errors and resume=auto's fresh start (5), an
oversized row (6), validation errors under torchrun (7). Multi-process cases run real torchrun jobs.
"""

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from dflash_mp import checkpoint as ckpt
from dflash_mp import rundir
from dflash_mp.config import compose
from dflash_mp.runtime import prepare

from e2e_utils import SMALL, scalars
from resilience_utils import finish, run, signal_workers, start

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


@pytest.fixture
def fresh_state():
    rundir.release()
    yield
    rundir.release()


def write_ckpt(root, step, run_id, world=3):
    tmp = ckpt.tmp_dir(root, step)
    os.makedirs(tmp, exist_ok=True)
    ckpt.save_file({"w": torch.ones(2)}, os.path.join(tmp, "drafter.pt"))
    return ckpt.commit(root, step, {"num_steps": 8, "world_size": world, "run_id": run_id}, keep=5)


def digest(path):
    """Every file under `path` with its content hash: what 'nothing lost' compares."""
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, path)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def console_failures(out: str) -> list[str]:
    """The one-line fatal messages the ranks printed (rundir.fail's format)."""
    return re.findall(r"^\[[^\]]* ERROR dflash_mp\.rundir\] (.*)$|^(rank \d+ failed: .*)$", out, re.M)


def no_package_traceback(out: str) -> bool:
    """No traceback frame of the package on the console (torchrun's own launcher frames are its own)."""
    return not re.search(r'File ".*dflash_mp/', out)


# ------------------------------------------------------------------ case 2: two jobs in one run_dir
LONG = SMALL + ["data.max_rows=40", "checkpoint.every=0", "train.stop_grace_s=20"]
# Job A trains until the fixture stops it: however slow B's start-up on a loaded machine, A still holds the
# run_dir when B asks for it (A's 200 steps were once over before B was refused, on 2 cores shared by 3
# test workers). B, if it were let in, would end by itself.
UNTIL_STOPPED, B_STEPS = "train.max_steps=1000000", "train.max_steps=200"


def _json(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return {}


@pytest.fixture(scope="module")
def contested(tmp_path_factory):
    """Job A runs; job B (other lr) starts in the same run_dir and must be refused; then A is
    stopped by SIGTERM (checkpoint, exit 0)."""
    run_dir = str(tmp_path_factory.mktemp("contested") / "run")
    a = start(2, LONG + [UNTIL_STOPPED, f"run_dir={run_dir}"])
    deadline = time.time() + 120
    while "run_id" not in _json(f"{run_dir}/run.json"):  # A has claimed the directory
        assert a.poll() is None and time.time() < deadline, "job A ended early"
        time.sleep(0.2)
    rc_b, out_b, _ = run(2, LONG + [B_STEPS, f"run_dir={run_dir}", "train.lr=5e-3"], timeout=180)
    a_ran_throughout = a.poll() is None
    if a_ran_throughout:
        signal_workers(a.pid)
    rc_a, out_a, _ = finish(a, timeout=90)
    return run_dir, rc_a, out_a, rc_b, out_b, a_ran_throughout


@pytest.mark.slow
def test_case2_a_second_job_in_a_used_run_dir_is_refused_naming_the_holder(contested):
    run_dir, rc_a, out_a, rc_b, out_b, a_ran_throughout = contested
    owner = json.load(open(f"{run_dir}/run.json"))
    assert rc_b != 0, "the second job ran"
    assert a_ran_throughout, "job A ended before B was refused: the test proves nothing"
    lines = console_failures(out_b)
    assert len(lines) == 1, out_b[-4000:]  # once per job, not once per rank
    assert f"run_dir={run_dir} is in use by another job" in out_b
    assert f"pid {owner['pid']}" in out_b and owner["host"] in out_b and owner["run_id"] in out_b
    assert no_package_traceback(out_b), out_b[-4000:]
    # A finished its own run untouched: its config, checkpoint and every scalar row are its own.
    assert rc_a == 0, out_a[-4000:]
    assert "lr: 0.001" in open(f"{run_dir}/config.yaml").read()
    (done,) = ckpt.complete_checkpoints(f"{run_dir}/checkpoints")
    assert ckpt.read_manifest(done)["run_id"] == owner["run_id"]
    rows = scalars(run_dir) + scalars(run_dir, "target")
    assert rows and {r["run_id"] for r in rows} == {owner["run_id"]}
    # B wrote nothing into A's directory, not even log lines.
    logs = "".join(open(os.path.join(run_dir, "logs", f)).read() for f in os.listdir(f"{run_dir}/logs"))
    assert "in use by another job" not in logs and "rank 0" not in " ".join(os.listdir(f"{run_dir}/logs"))


# ------------------------------------------------------------ case 1: a fresh run in a used run_dir
@pytest.mark.slow
def test_case1_a_fresh_run_over_another_runs_checkpoints_is_refused_and_loses_nothing(contested, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(contested[0], run_dir)  # A's finished directory, stopped with a checkpoint
    before = digest(f"{run_dir}/checkpoints")
    rc, out, _ = run(2, SMALL + [f"run_dir={run_dir}", "train.max_steps=12", "checkpoint.every=5",
                                 "drafter.num_layers=2"], timeout=120)
    assert rc != 0
    assert len(console_failures(out)) == 1, out[-4000:]
    msg = console_failures(out)[0]
    msg = msg[0] or msg[1]
    assert f"run_dir={run_dir}" in msg
    assert "checkpoint.resume=auto" in msg and "checkpoint.overwrite=true" in msg
    assert no_package_traceback(out), out[-4000:]
    assert digest(f"{run_dir}/checkpoints") == before  # nothing pruned, nothing replaced


def test_overwrite_replaces_the_old_run_and_pruning_keeps_to_its_own_run(tmp_path, fresh_state, caplog):
    run_dir = str(tmp_path / "run")
    root = f"{run_dir}/checkpoints"
    for step in (15, 20):
        write_ckpt(root, step, "old")
    os.makedirs(f"{run_dir}/export")
    open(f"{run_dir}/export/config.json", "w").write("{}")
    job = compose([f"run_dir={run_dir}"])
    with pytest.raises(ValueError, match=r"checkpoint.overwrite=true") as err:
        rundir.claim(job, 0, "")
    assert "step_00000015, step_00000020, export" in str(err.value)
    assert len(ckpt.complete_checkpoints(root)) == 2 and os.path.exists(f"{run_dir}/export/config.json")
    rundir.release()
    # Resuming the old run is allowed and keeps its id.
    assert rundir.claim(job, 0, "auto") == "old"
    rundir.release()
    # An explicit overwrite deletes the old run's files, saying so.
    job = compose([f"run_dir={run_dir}", "checkpoint.overwrite=true"])
    with caplog.at_level(logging.WARNING, logger="dflash_mp.rundir"):
        new = rundir.claim(job, 0, "")
    assert new != "old" and json.load(open(f"{run_dir}/run.json"))["run_id"] == new
    assert "checkpoint.overwrite=true: deleting" in caplog.text and "step_00000020" in caplog.text
    assert not ckpt.complete_checkpoints(root) and not os.path.exists(f"{run_dir}/export")
    # Pruning only ever removes the current run's own older checkpoints (never a higher foreign step).
    for step in (15, 20):
        write_ckpt(root, step, "other")
    for step in (5, 10, 12):
        tmp = ckpt.tmp_dir(root, step)
        os.makedirs(tmp)
        ckpt.save_file({"w": torch.ones(2)}, os.path.join(tmp, "drafter.pt"))
        ckpt.commit(root, step, {"num_steps": 12, "world_size": 3, "run_id": new}, keep=2)
    assert sorted(os.listdir(root)) == ["step_00000010", "step_00000012", "step_00000015", "step_00000020"]


def test_the_export_carries_the_run_id(tmp_path):
    from dflash_mp.export import export_drafter, load_exported
    from dflash_mp.model import DFlashDrafter

    from drafter_utils import tiny_args

    args = tiny_args()
    out = export_drafter(DFlashDrafter(args), args, tmp_path / "export", run_id="20260101-000000-abcdef")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["dflash_run_id"] == "20260101-000000-abcdef"
    load_exported(out)  # still the public layout


HOLD = """
import sys, time
sys.path.insert(0, {src!r})
from dflash_mp import rundir
from dflash_mp.config import compose
rundir.claim(compose(["run_dir={run_dir}"]), 0, "")
print("claimed", flush=True)
time.sleep(120)
"""


def test_a_lock_left_by_a_killed_job_is_taken_over(tmp_path, fresh_state, caplog):
    run_dir = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(src=SRC, run_dir=run_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(rundir.RunDirBusy, match=rf"in use by another job .*pid {holder.pid}"):
            rundir.claim(compose([f"run_dir={run_dir}"]), 0, "")
    finally:
        holder.send_signal(signal.SIGKILL)  # the process this test started, by its own handle
        holder.wait()
    with caplog.at_level(logging.INFO, logger="dflash_mp.rundir"):
        rundir.claim(compose([f"run_dir={run_dir}"]), 0, "")
    assert f"pid {holder.pid}" in caplog.text and "no longer runs" in caplog.text


# --------------------------------------------------------------------------- case 3: rejected rows
def _rows(path, rows):
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("kind,reason,fix", [
    ("no_messages", "missing_field=6", "data.messages_field"),
    ("user_only", "no_assistant=6", "dflash_mp.regenerate"),
    ("binary", "invalid_utf8", "point data.path at a chat .jsonl"),
    ("small_vocab", "token_out_of_vocab=6", "target.path"),
])
def test_case3_when_every_row_is_rejected_the_error_names_why(tmp_path, kind, reason, fix):
    from dflash_mp.data import build_stream

    path = str(tmp_path / "data.jsonl")
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
    if kind == "no_messages":
        _rows(path, [{"text": "hi"}] * 6)
    elif kind == "user_only":
        _rows(path, [{"messages": chat[:1]}] * 6)
    elif kind == "binary":
        open(path, "wb").write(bytes(range(128, 256)) * 20)
    else:
        _rows(path, [{"messages": chat}] * 6)
    job = compose([f"data.path={path}"])
    res = prepare(job)
    tok, tcfg = res.tokenizer, res.target_config
    with pytest.raises(ValueError) as err:
        build_stream(job.data, tok, 0, 1, vocab_limit=10 if kind == "small_vocab" else tcfg["vocab_size"])
    msg = str(err.value)
    assert f"data.path={path!r}: 0 usable rows" in msg and reason in msg and fix in msg, msg


def test_case3_an_empty_jsonl_is_a_clear_error_in_training_and_regenerate(tmp_path):
    from dflash_mp.data import build_stream
    from dflash_mp.regenerate import RegenConfig, regenerate_file

    path = str(tmp_path / "empty.jsonl")
    open(path, "w").close()
    job = compose([f"data.path={path}"])
    tok = prepare(job).tokenizer
    with pytest.raises(ValueError, match=r"data.path=.*empty.jsonl' holds no rows \(an empty file\?\)"):
        build_stream(job.data, tok, 0, 1)
    with pytest.raises(ValueError, match="holds no rows"):
        regenerate_file(job, RegenConfig(out=str(tmp_path / "out.jsonl")))


# ------------------------------------------------------------------------ case 5: path errors
def test_case5_a_missing_target_path_names_the_setting():
    with pytest.raises(ValueError, match=r"^target.path='/no/such/dir' is not a model directory") as err:
        prepare(compose(["target.path=/no/such/dir"]))
    assert err.value.__cause__ is None and err.value.__context__ is None  # no hub traceback chain


def test_case5_evaluate_on_a_training_checkpoint_points_at_the_export(tmp_path):
    from dflash_mp.evaluate import EvalConfig, evaluate

    step = write_ckpt(str(tmp_path / "run" / "checkpoints"), 20, "r")
    with pytest.raises(ValueError) as err:
        evaluate(compose([]), EvalConfig(checkpoint=step))
    assert f"checkpoint={step} is a training checkpoint" in str(err.value)
    assert f"lives in {tmp_path / 'run' / 'export'}" in str(err.value)
    out = subprocess.run([sys.executable, "-m", "dflash_mp.evaluate", f"checkpoint={step}"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith("error: checkpoint=")


def test_case5_resume_auto_says_in_one_line_that_it_starts_fresh(tmp_path, fresh_state, caplog):
    run_dir = str(tmp_path / "run")
    job = compose([f"run_dir={run_dir}"])
    with caplog.at_level(logging.INFO):
        rundir.claim(job, 0, "auto")
    assert "checkpoint.resume=auto: starting fresh: it holds no checkpoint" in caplog.text
    rundir.release()
    caplog.clear()
    torn = write_ckpt(f"{run_dir}/checkpoints", 4, "x")
    os.remove(os.path.join(torn, "manifest.json"))
    with caplog.at_level(logging.INFO):
        rundir.claim(job, 0, "auto")
        assert ckpt.validate_resume("auto", f"{run_dir}/checkpoints", [1, 2], 3) is None
    lines = [r.getMessage() for r in caplog.records if "step_00000004" in r.getMessage()]
    assert lines == [f"checkpoint.resume=auto: starting fresh: its only checkpoints (step_00000004) are "
                     f"incomplete under {run_dir}/checkpoints"], lines


# ----------------------------------------------------------------------- case 6: an oversized row
BIG = """
import json, resource, sys
sys.path.insert(0, {src!r})
from dflash_mp.config import compose
from dflash_mp.data import load_conversations, tokenize_dataset
from dflash_mp.runtime import prepare
job = compose(["data.path={path}", "data.max_row_chars={limit}"])
res = prepare(job)
tok, tcfg = res.tokenizer, res.target_config
ds = load_conversations(job.data)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kept, skipped = tokenize_dataset(ds, tok, job.data, tcfg["vocab_size"])
print(json.dumps({{"kept": len(kept), "skipped": dict(skipped),
                  "rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}}))
"""


def test_case6_an_oversized_row_is_skipped_before_tokenizing_with_bounded_memory(tmp_path):
    src = os.path.join(SRC, "dflash_mp", "assets", "demo_chat.jsonl")
    rows = open(src).read().splitlines()[:8]
    path = str(tmp_path / "big.jsonl")
    huge = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "word " * 800_000}]}
    with open(path, "w") as f:  # one 4 MB row among ordinary ones
        f.write("\n".join(rows[:4] + [json.dumps(huge)] + rows[4:]) + "\n")
    out = subprocess.run([sys.executable, "-c", BIG.format(src=SRC, path=path, limit=100_000)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kept"] == 8 and got["skipped"] == {"row_too_long": 1}
    assert got["rss_mb"] < 100, got  # tokenizing it costs ~600 MB


# ---------------------------------------------------- case 7: validation errors under torchrun
@pytest.mark.parametrize("override,message", [
    ("data.split=test", "data.split='test': local files only have a 'train' split"),  # the config itself
])
def test_case7_a_validation_error_is_one_line_once_per_job_before_any_group(tmp_path, override, message):
    run_dir = str(tmp_path / "run")
    rc, out, _ = run(3, SMALL + [f"run_dir={run_dir}", override], timeout=120)
    assert rc != 0
    lines = console_failures(out)
    assert len(lines) == 1 and message in "".join(lines[0]), out[-4000:]
    assert no_package_traceback(out), out[-4000:]
    assert "topology:" not in out  # failed before any process group
    # The traceback went to the failing rank's own log file, which the line names.
    rank, log_path = re.search(r"rank (\d+) failed: .*\(traceback: (.*)\)", "".join(lines[0])).groups()
    assert log_path == f"{run_dir}/logs/rank_{rank}.log"
    log_text = open(log_path).read()
    assert "Traceback" in log_text and message in log_text
