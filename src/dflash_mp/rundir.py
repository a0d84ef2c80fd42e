"""A run directory holds one run, and a fatal error reaches the user once, in one line.

Ownership. Global rank 0 claims `run_dir` before any process group exists, under a short claim
mutex (`.claim.lock`, `fsutil.file_lock`): it takes `run.lock` exclusively without waiting, which
succeeds only when no process of another job still holds it, then turns its lock shared; every
other rank takes it shared too, once rank 0 has published the claim. A job therefore owns the
directory until its last rank exits (the target leader may finish before the drafters export), and
however a rank ends (kill -9 included) the kernel drops its lock: a crashed job never leaves a stale
lock to clean up. The lock is an flock: on NFS Linux maps it onto POSIX byte-range locks, which hold
across hosts. `run.json` names the owner (host, pid, start time) and the run id.

Run id. A fresh run gets a new id; `checkpoint.resume=auto` (or a step directory) continues the run
its checkpoint names. The id is written in `run.json` and carried by every checkpoint manifest, the
export's safetensors metadata and every `scalars.jsonl` row; pruning only removes the current run's
own older checkpoints. A fresh run into a directory that holds another run's complete checkpoints or
export is refused unless `checkpoint.overwrite=true`, which deletes that run's files (logged).

Errors. Every rank logs to `<run_dir>/logs/rank_<N>.log` (lines from before the claim are buffered,
so a job refused for a busy directory writes nothing into it). A fatal error prints one line,
`<role> rank <N> failed: <message> (traceback: <log>)`, on the console of the first rank to fail in
the job (agreed through the job's rendezvous store: ranks fail in any order, and validation errors
hit every rank at once); the traceback goes to the rank's log file only, and torchrun's summary
gets the same one line instead of a traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import logging.handlers
import os
import secrets
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field

from . import checkpoint as ckpt
from .fsutil import file_lock, try_lock
from .resilience import fail_fast

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
CLAIM_FILE = ".claim.lock"
LOG_DIR = "logs"
EXPORT_DIR = "export"
_CLAIM_KEY = "dflash_rundir_claim"
_FATAL_KEY = "dflash_fatal"


class RunDirBusy(ValueError):
    """Another job owns the run directory: this job must not write into it, not even its logs."""


@dataclass
class _State:
    rank: int = field(default_factory=lambda: int(os.environ.get("RANK", 0) or 0))
    role: str = ""
    store: object = None
    store_factory: object = None
    lock_fd: int | None = None
    run_id: str | None = None
    log_path: str | None = None
    buffer: logging.handlers.MemoryHandler | None = None
    fmt: str = "%(message)s"
    extra: dict = field(default_factory=dict)


STATE = _State()


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def run_id() -> str | None:
    """This process's run id (None before the claim)."""
    return STATE.run_id


# ----------------------------------------------------------------------------------------- logging
def buffer_rank_log(rank: int, role: str, fmt: str, run_dir: str | None = None) -> None:
    """Hold this rank's log records until the run directory is claimed (see the module docstring)."""
    STATE.rank, STATE.role, STATE.fmt = rank, role, fmt
    if run_dir:
        STATE.extra["run_dir"] = os.path.abspath(run_dir)
    if STATE.buffer is None:
        STATE.buffer = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1)
        STATE.buffer.setLevel(logging.INFO)
        logging.getLogger().addHandler(STATE.buffer)


def open_rank_log(run_dir: str) -> str:
    """Start `<run_dir>/logs/rank_<N>.log` (appended across attempts) with the buffered records."""
    if STATE.log_path is not None:
        return STATE.log_path
    path = os.path.join(run_dir, LOG_DIR, f"rank_{STATE.rank}.log")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter(STATE.fmt, datefmt="%H:%M:%S"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    if STATE.buffer is not None:
        STATE.buffer.setTarget(handler)
        STATE.buffer.flush()
        root.removeHandler(STATE.buffer)
        STATE.buffer = None
    root.addHandler(handler)
    STATE.log_path = path
    return path


def _quiet_console() -> None:
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.setLevel(logging.CRITICAL + 1)


# ----------------------------------------------------------------------------------------- failures
def use_store(store) -> None:
    """The job's rendezvous store: the claim and the one-console-line agreement go through it."""
    STATE.store = store


def _first_failure() -> bool:
    # Only the torchrun agent's store outlives a failed rank 0; without it peers would wait to connect.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if STATE.store is None and STATE.store_factory is not None and agent_store:
        with contextlib.suppress(Exception):
            STATE.store = STATE.store_factory()
    if STATE.store is None:
        return STATE.rank == 0
    try:
        return STATE.store.add(_FATAL_KEY, 1) == 1
    except Exception:  # noqa: BLE001 - the store's agent is gone: say it rather than nothing
        return True


def describe(exc: BaseException) -> str:
    """A user error (ValueError) is its message; anything else keeps its type."""
    msg = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    return " ".join(msg.split())  # one line, whatever the message's own layout


def fail(exc: BaseException, role: str = "", rank: int | None = None, run_dir: str | None = None) -> None:
    """Report a fatal error (see the module docstring) and exit at once, through `fail_fast`."""
    rank = STATE.rank if rank is None else rank
    role = role or STATE.role
    if not logging.getLogger().handlers:  # failed before setup_logging (config composition)
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    path = None
    if not isinstance(exc, RunDirBusy):
        with contextlib.suppress(Exception):
            path = open_rank_log(run_dir) if run_dir else STATE.log_path
    line = f"{role + ' ' if role else ''}rank {rank} failed: {describe(exc)}"
    if path:
        line += f" (traceback: {path})"
    if _first_failure():
        log.error("%s", line)
    _quiet_console()
    err_file = os.environ.pop("TORCHELASTIC_ERROR_FILE", None)
    if err_file:  # torchrun's end-of-job summary shows this line, not a traceback
        with contextlib.suppress(OSError), open(err_file, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    if STATE.buffer is not None:  # refused for a busy run_dir: nothing is written into it
        logging.getLogger().removeHandler(STATE.buffer)
    fail_fast(exc, role or "job", rank)  # traceback to the log file only, then os._exit(1)


@contextlib.contextmanager
def fatal_errors(store_factory=None, run_dir: str | None = None):
    """Around a rank's whole life: any exception ends it through `fail`. `store_factory` makes the
    job's store, `run_dir` places the log, for an error raised before the rank set them (a bad config)."""
    STATE.store_factory = store_factory
    if run_dir:
        STATE.extra["run_dir"] = os.path.abspath(run_dir)
    try:
        yield
    except Exception as e:  # noqa: BLE001
        fail(e, run_dir=STATE.extra.get("run_dir"))


# ------------------------------------------------------------------------------------------ claim
def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _owner(info: dict) -> str:
    if not info.get("pid"):
        return "a job that has not yet written run.json"
    return f"run {info.get('run_id', '?')} on host {info.get('host', '?')}, pid {info.get('pid')}, " \
           f"started at {info.get('started_at', '?')}"


def _manifest_run_id(path: str) -> str | None:
    try:
        return ckpt.read_manifest(path).get("run_id")
    except ValueError:
        return None


def _torn(root: str, done: list[str]) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if ckpt._STEP_RE.match(n) and os.path.join(root, n) not in done)


def _remove(paths: list[str], why: str) -> None:
    for p in paths:
        log.warning("checkpoint.overwrite=true: deleting %s (%s)", p, why)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)


def _decide(job, resume: str, run_dir: str, prev: dict) -> str:
    """The run id of this job; refuses (ValueError) to start over another run's checkpoints or export."""
    root = job.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    done = ckpt.complete_checkpoints(root)
    export = os.path.join(run_dir, EXPORT_DIR)
    if resume == "auto":
        if done:
            rid = _manifest_run_id(done[-1]) or prev.get("run_id") or new_run_id()
            newer = [n for n in _torn(root, done) if n > os.path.basename(done[-1])]
            log.info("checkpoint.resume=auto: continuing run %s from %s%s", rid, done[-1],
                     f" (newer but incomplete: {', '.join(newer)})" if newer else "")
            return rid
        torn = _torn(root, done)
        why = f"its only checkpoints ({', '.join(torn)}) are incomplete" if torn else "it holds no checkpoint"
        log.info("checkpoint.resume=auto: starting fresh: %s under %s", why, root)
    elif resume:
        rid = _manifest_run_id(resume) or new_run_id()
        same = lambda p: os.path.realpath(p) == os.path.realpath(resume)  # noqa: E731
        others = [p for p in done if _manifest_run_id(p) != rid and not same(p)]
        if others:
            _refuse_or_remove(job, others, [], prev, f"checkpoint.resume={resume}")
        return rid
    victims = list(done)
    exported = os.path.isfile(os.path.join(export, "config.json"))
    if victims or exported:
        _refuse_or_remove(job, victims, [export] if exported else [], prev, "a fresh run")
        leftovers = [os.path.join(root, n) for n in _torn(root, [])]
        leftovers += [os.path.join(run_dir, n) for n in ("tb", LOG_DIR, "config.yaml")]
        _remove([p for p in leftovers if os.path.exists(p)], "the replaced run's logs and torn checkpoints")
    elif prev.get("run_id"):
        log.info("run_dir %s: run %s left no checkpoint or export; starting a new run here", run_dir,
                 prev["run_id"])
    return new_run_id()


def _refuse_or_remove(job, checkpoints: list[str], exports: list[str], prev: dict, what: str) -> None:
    names = [os.path.basename(p) for p in checkpoints] + [os.path.relpath(p, job.run_dir) for p in exports]
    owner = f"run {prev['run_id']}" if prev.get("run_id") else "an earlier run"
    if not job.checkpoint.overwrite:
        raise ValueError(
            f"run_dir={job.run_dir} holds {owner}'s checkpoints/export ({', '.join(names)}); {what} "
            "would mix with them (pruning, checkpoint.resume=auto): continue that run with "
            "checkpoint.resume=auto, pick another run_dir (or name=...), or delete them with "
            "checkpoint.overwrite=true.")
    _remove(checkpoints + exports, f"{owner}'s, replaced by this run")


def claim(job, rank: int, resume: str) -> str:
    """Claim `job.run_dir` for this job (module docstring); the run id. Before any process group:
    rank 0 decides and publishes through the store; the other ranks wait for its answer."""
    run_dir = os.path.abspath(job.run_dir)
    STATE.extra["run_dir"] = run_dir
    store = STATE.store
    if rank == 0:
        try:
            rid = _claim_as_owner(job, run_dir, resume)
            answer = {"run_id": rid}
        except ValueError as e:
            answer = {"error": str(e), "busy": isinstance(e, RunDirBusy)}
            if store is not None:
                store.set(_CLAIM_KEY, json.dumps(answer))
            raise
        if store is not None:
            store.set(_CLAIM_KEY, json.dumps(answer))
    else:
        if store is None:
            raise RuntimeError("ranks other than 0 need the job's store to learn the run directory's claim")
        store.wait([_CLAIM_KEY])
        answer = json.loads(store.get(_CLAIM_KEY))
        if "error" in answer:
            raise (RunDirBusy if answer["busy"] else ValueError)(answer["error"])
        os.makedirs(run_dir, exist_ok=True)  # another node without a shared file system
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)  # held until this process ends: the job owns the dir till then
        STATE.lock_fd = fd
    STATE.run_id = answer["run_id"]
    path = open_rank_log(run_dir)
    log.info("run %s, run_dir %s (this rank's log: %s)", STATE.run_id, run_dir, path)
    return STATE.run_id


def _claim_as_owner(job, run_dir: str, resume: str) -> str:
    os.makedirs(run_dir, exist_ok=True)
    with file_lock(os.path.join(run_dir, CLAIM_FILE)):  # claims one at a time: no race on run.lock
        run_file = os.path.join(run_dir, RUN_FILE)
        prev = _read_json(run_file)
        fd = try_lock(os.path.join(run_dir, LOCK_FILE))
        if fd is None:
            raise RunDirBusy(
                f"run_dir={job.run_dir} is in use by another job ({_owner(prev)}): wait for it to end, "
                "stop it, or give this job another run_dir (or name=...).")
        fcntl.flock(fd, fcntl.LOCK_SH)  # this job's other ranks share it; claimers wait on CLAIM_FILE
        STATE.lock_fd = fd
        if prev.get("pid"):
            log.info("run_dir %s: last used by %s, which no longer runs", run_dir, _owner(prev))
        rid = _decide(job, resume, run_dir, prev)
        now = datetime.datetime.now().isoformat(timespec="seconds")
        _write_json(run_file, {
            "run_id": rid, "host": socket.gethostname(), "pid": os.getpid(), "started_at": now,
            "created_at": prev.get("created_at", now) if prev.get("run_id") == rid else now,
            "argv": sys.argv[1:],
        })
    return rid


def release() -> None:
    """Drop this process's claim and rank log (in-process tools and tests that claim more than once;
    a rank never needs it: its exit releases both)."""
    if STATE.lock_fd is not None:
        os.close(STATE.lock_fd)
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler) and h.baseFilename == STATE.log_path:
            root.removeHandler(h)
            h.close()
    if STATE.buffer is not None:
        root.removeHandler(STATE.buffer)
    STATE.lock_fd = STATE.run_id = STATE.log_path = STATE.buffer = None
    STATE.extra.clear()
