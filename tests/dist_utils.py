"""Run a function on N real processes joined by torch.distributed, for multi-rank tests.

    results = run_ranks(fn, 3, arg1, arg2, timeout=30)   # fn(rank, world_size, arg1, arg2)

Each rank is a fresh process (forkserver with torch preloaded, so a rank starts in well under a
second instead of re-importing torch); `fn` must be a module-level function. The parent owns the
TCPStore on an OS-chosen localhost port, so concurrent test runs never race for a port. Every rank
pickles its return value (or its traceback) to a file the parent reads back: a failure on any rank
raises in the test with that rank's traceback, a rank killed by a signal shows its exit code, and a
hung rank is killed at `timeout` and reported, so a test never hangs.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
from multiprocessing import forkserver
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

_HOST = "127.0.0.1"


@dataclass
class RankFailure:
    """What a rank left behind when it did not return normally."""

    rank: int
    exitcode: int | None  # None: still running at the deadline (then killed)
    error: str  # "ExcType: message", or how the process ended
    traceback: str = ""

    def __str__(self) -> str:
        return f"rank {self.rank} (exitcode {self.exitcode}): {self.error}\n{self.traceback}"


def _child(fn, rank, world_size, port, backend, pg_timeout_s, result_path, args) -> None:
    torch.set_num_threads(1)  # several ranks share a couple of cores in CI
    outcome: tuple
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        wait = datetime.timedelta(seconds=60)
        store = dist.TCPStore(_HOST, port, world_size, is_master=False, timeout=wait)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        outcome = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    tmp = f"{result_path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(tmp, result_path)  # the parent never reads a half-written file
    if outcome[0] != "ok":
        os._exit(1)


def process_context(fn, start_method: str = "forkserver"):
    """The multiprocessing context ranks start from (also for tests that start plain processes)."""
    if start_method != "forkserver" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # The server imports these once (at its start, i.e. on the first call) instead of every rank
    # importing them: torch, and the first caller's module with whatever it imports. The server does
    # not get our sys.path (CPython 3.11 ignores it), so the module's folder goes in PYTHONPATH.
    module = sys.modules.get(fn.__module__)
    preload = ["torch", "torch.distributed"]
    env = os.environ.get("PYTHONPATH")
    if fn.__module__ != "__main__" and getattr(module, "__file__", None):
        preload.append(fn.__module__)
        paths = [os.path.dirname(module.__file__)] + ([env] if env else [])
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    ctx.set_forkserver_preload(preload)
    try:
        forkserver.ensure_running()
    finally:
        if env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env
    return ctx


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 60.0,
    backend: str = "gloo",
    allow_failures: bool = False,
    pg_timeout_s: float = 60.0,
    start_method: str = "forkserver",
) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return the per-rank results.

    With `allow_failures`, a rank that raised, died or hung yields a `RankFailure` in its place
    instead of failing the call (for tests where a rank is meant to fail or be killed).
    Ranks that use CUDA need start_method="spawn": the fork server may have touched CUDA (a test
    module's skipif asking for the device count is enough), and CUDA does not survive a fork.
    """
    store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False)
    ctx = process_context(fn, start_method)
    with tempfile.TemporaryDirectory(prefix="dist_utils_") as tmp:
        paths = [Path(tmp) / f"rank{r}.pkl" for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, store.port, backend, pg_timeout_s, str(paths[r]), args),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:  # only the processes started above, by their own pid
            os.kill(procs[r].pid, signal.SIGKILL)
            procs[r].join()
        results: list = []
        for r, p in enumerate(procs):
            if r in hung:
                results.append(RankFailure(r, None, f"still running after {timeout:.0f} s, killed"))
            elif paths[r].exists():
                outcome = pickle.loads(paths[r].read_bytes())
                ok = outcome[0] == "ok"
                results.append(outcome[1] if ok else RankFailure(r, p.exitcode, outcome[1], outcome[2]))
            else:
                code = p.exitcode or 0
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else "no result"
                results.append(RankFailure(r, p.exitcode, how))
    failures = [x for x in results if isinstance(x, RankFailure)]
    if failures and not allow_failures:
        raise RuntimeError("multi-rank run failed:\n" + "\n".join(str(f) for f in failures))
    return results
