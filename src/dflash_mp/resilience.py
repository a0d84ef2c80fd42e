"""Nothing lost, nothing hangs: restarts, graceful stops, fast failure, fault injection.

* Restart: under `torchrun --max-restarts N` a failed worker makes the agent restart every worker
  with `TORCHELASTIC_RESTART_COUNT` > 0. Such a restart resumes as `checkpoint.resume=auto` (the
  newest complete checkpoint under the checkpoint dir) whatever `checkpoint.resume` says, so a
  crash costs at most the steps since the last checkpoint and never restarts training from zero.
* Graceful stop: SIGTERM (what Slurm and the torchrun agent send) sets a flag. Every rank joins a
  flag all-reduce (MAX, gloo control group) at check steps `c` (multiples of `logging.log_every`);
  if any rank was signalled, the job stops after step `c + log_every`: the drafters train up to it,
  write a checkpoint and exit 0; the targets stop sending at it. Drafters block on the check; targets
  post it asynchronously at the top of step `c` and wait for it only at the top of step
  `c + log_every`, so the check never drains the target -> drafter pipeline. The check is a
  host-side gloo collective on a CPU tensor: no CUDA synchronisation on GPU.
* Grace: from the first SIGTERM a watchdog thread gives the process `train.stop_grace_s` plus the
  longest checkpoint it has measured so far; a rank still running then (stuck in a collective, a hung
  peer) logs and `os._exit(1)`s. A checkpoint or export under way (`StopSignal.protect`) is never cut
  short, nor is a peer's the rank waits for: the deadline waits for it to end (up to
  `liveness.checkpointing_s`) and the grace counts again from its end, since the agreed stop still
  has steps to run after it. So a stop at any moment ends with the newest complete checkpoint on
  disk and exit 0. A rank the grace ends before any drafter has finished a step of this attempt
  (the job still starting or compiling its first step) exits 0 too: nothing was trained to save.
  The watchdog hears the signal through `signal.set_wakeup_fd`, so it fires even
  while the main thread sits inside a C++ collective that never returns to Python.
* Fast failure: a rank whose role raises logs the error naming itself, records it for torchrun, and
  `os._exit(1)`s without `destroy_process_group` (which can block on a dead peer); the agent then
  tears the others down.
* Faults for tests: `DFLASH_MP_FAULT=<rank>:<step>[:<action>]` makes global rank `<rank>`, on the
  first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0), at step `<step>`:
  `kill`       SIGKILL itself at the top of 0-based step `<step>` (after `<step>` steps are done);
  `checkpoint` SIGKILL itself while writing the checkpoint of step `<step>`, between two files;
  `hang`       stop at the top of step `<step>` and sleep forever (alive, silent);
  `slow_checkpoint` the leader's write of the checkpoint of step `<step>` takes 8 s longer;
  `stall`      pause 1 s at the top of step `<step>`, then go on (a target's pause empties its
               drafters' rings: bench/run_stall_h200.sh times how the job refills them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

FAULT_ENV = "DFLASH_MP_FAULT"
FAULT_ACTIONS = ("kill", "checkpoint", "hang", "slow_checkpoint", "stall")


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def effective_resume(resume: str) -> str:
    """`checkpoint.resume` as this attempt uses it: a torchrun restart always resumes `auto`."""
    if restart_count() > 0 and resume != "auto":
        return "auto"
    return resume


# ------------------------------------------------------------------------------------------ faults
@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    action: str = "kill"

    @classmethod
    def parse(cls, spec: str) -> "Fault | None":
        if not spec:
            return None
        parts = spec.split(":")
        try:
            rank, step = int(parts[0]), int(parts[1])
            action = parts[2] if len(parts) > 2 else "kill"
        except (IndexError, ValueError):
            raise ValueError(f"{FAULT_ENV}={spec!r}: use <rank>:<step>[:<action>], e.g. 0:5:kill") from None
        if action not in FAULT_ACTIONS or len(parts) > 3:
            raise ValueError(f"{FAULT_ENV}={spec!r}: action must be one of {FAULT_ACTIONS}")
        return cls(rank, step, action)


def fault_from_env() -> Fault | None:
    """The injected fault of this attempt, or None (always None after a restart)."""
    return Fault.parse(os.environ.get(FAULT_ENV, "")) if restart_count() == 0 else None


def maybe_fault(fault: Fault | None, rank: int, step: int, *actions: str) -> None:
    """Carry out the injected fault if it is this rank's at this step and one of `actions` (the ones
    this point of the code can carry out)."""
    if fault is None or (fault.rank, fault.step) != (rank, step) or fault.action not in actions:
        return
    action = fault.action
    log.warning("FAULT %s: rank %d at step %d (t=%.3f)", action, rank, step, time.time())
    _flush()
    if action == "hang":
        while True:  # alive but silent: only a signal's watchdog or SIGKILL ends this
            time.sleep(60)
    if action == "slow_checkpoint":  # the leader's write of this step's checkpoint takes this long
        time.sleep(SLOW_CHECKPOINT_S)
        return
    if action == "stall":  # the rank pauses once and goes on (a target's pause drains its drafters' rings)
        time.sleep(STALL_S)
        return
    os.kill(os.getpid(), signal.SIGKILL)


SLOW_CHECKPOINT_S = 8.0
STALL_S = 1.0
# The longest a clean exit waits to tell the peers it is done (a beat written to the store; a store
# that no longer answers would hold the exit for its whole timeout).
CLEAN_EXIT_HOOK_S = 3.0


# --------------------------------------------------------------------------------- graceful stop
class StopSignal:
    """SIGTERM -> `requested`; from then on the process has `deadline_s()` to exit on its own, counted
    from the signal or from the end of the last checkpoint it waited for (module doc)."""

    def __init__(self, grace_s: float, max_protected_s: float = 1800.0):
        self.grace_s = grace_s
        self.max_protected_s = max_protected_s  # the longest a protected section may hold the exit back
        self.event = threading.Event()
        self.received_at: float | None = None
        self._rfd = self._wfd = None
        self._lock = threading.Lock()
        self._protected: dict[int, tuple[str, float]] = {}  # id -> (what, since)
        self.work_s = 0.0  # the longest protected section so far (a checkpoint, an export)
        # Other ranks still writing a checkpoint (Liveness.peers_in): a rank that waits for them at
        # the stop (a target for its drafters) waits as long as they write, not just its own grace.
        self.peers_busy: Callable[[], list[str]] = lambda: []
        self.none_trained: Callable[[], bool] = lambda: False  # no drafter step done in this attempt
        # Told before the watchdog's exit 0 (Liveness.done), so that peers do not take it for a death.
        self.on_clean_exit: Callable[[], None] = lambda: None
        self._finished = False

    @contextlib.contextmanager
    def protect(self, what: str):
        """A section a stop must let finish (a checkpoint's write, the export): the watchdog's
        deadline waits for it, and its duration lengthens the grace of later stops."""
        key, t0 = object(), time.monotonic()
        with self._lock:
            self._protected[id(key)] = (what, t0)
        try:
            yield
        finally:
            with self._lock:
                del self._protected[id(key)]
                self.work_s = max(self.work_s, time.monotonic() - t0)

    def finished(self) -> None:
        """The rank's work is done (checkpoint and export on disk): a signal from now on has nothing
        to stop. SIGTERM/SIGINT are ignored (Python resets its own handlers to the default at
        interpreter exit, so a signal during a slow teardown would kill a finished rank with -15),
        and a watchdog already counting ends the process with 0."""
        self._finished = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def deadline_s(self) -> float:
        """The grace in seconds: the configured one plus the longest checkpoint measured (the stop
        writes one more), counted from the signal or from the end of a checkpoint the rank waited for."""
        return self.grace_s + self.work_s

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def install(self) -> "StopSignal":
        """Main thread only. Later handlers that chain to this one (the shm transport's) are fine."""
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        # SIGINT too: Ctrl-C at the console reaches every worker; it stops them like SIGTERM, with a
        # checkpoint, instead of a KeyboardInterrupt traceback per rank. A second Ctrl-C exits at once.
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="dflash-stop-watchdog", daemon=True).start()
        return self

    def _on_signal(self, signum, frame) -> None:
        self.event.set()

    def _watch(self) -> None:
        # The C-level handler writes the signal number to the wakeup fd even while the main thread
        # is blocked in C++ (it runs the Python handler only when it returns to the interpreter).
        wanted = (signal.SIGTERM, signal.SIGINT)
        while True:
            data = os.read(self._rfd, 64)
            got = [s for s in wanted if s in data]
            if got:
                break
        self.received_at = t0 = time.monotonic()
        self.event.set()
        log.warning("%s: stopping at the next agreed step with a checkpoint; hard exit in %.0f s "
                    "(train.stop_grace_s=%.0f + %.0f s measured for a checkpoint), later while one is written",
                    signal.Signals(got[0]).name, self.deadline_s(), self.grace_s, self.work_s)
        threading.Thread(target=self._second_interrupt, name="dflash-second-sigint", daemon=True).start()
        noted, held = False, t0  # held: when a checkpoint (this rank's or a peer's) was last seen under way
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            with self._lock:
                busy = sorted(self._protected.values(), key=lambda x: x[1])
            if busy and now - busy[0][1] < self.max_protected_s:
                held = now
                continue  # a checkpoint or export under way: cutting it short would lose it
            peers = _ask(self.peers_busy, []) if now - t0 < self.deadline_s() + self.max_protected_s else []
            if peers:
                held = now  # the stop this rank waits for cannot land before the peer's checkpoint ends
                if now - t0 > self.deadline_s() and not noted:  # once: why this rank outlives its grace
                    noted = True
                    log.warning("grace over, but %s: waiting for it", "; ".join(peers))
                continue
            # The grace counts from the end of the last hold-up: the stop still has steps to run after it.
            if now - held > self.deadline_s():
                break
        if self._finished or _ask(self.none_trained, False):  # nothing to lose: a clean exit
            why = ("work done, teardown still running" if self._finished else
                   "stopped before any drafter finished a step of this attempt (still starting or compiling): "
                   "nothing trained to save beyond the checkpoint it started from")
            log.warning("%s %.0f s after the signal: exiting 0", why, now - t0)
            _ask(self.on_clean_exit, None, within_s=CLEAN_EXIT_HOOK_S)
            _flush()
            os._exit(0)
        what = f" ({busy[0][0]} for {now - busy[0][1]:.0f} s)" if busy else ""
        log.error("did not stop within %.0f s after the signal%s (stuck on a peer?): exiting",
                  now - t0, what)
        _flush()
        os._exit(1)

    def _second_interrupt(self) -> None:
        while signal.SIGINT not in os.read(self._rfd, 64):
            pass
        log.error("second interrupt: exiting now, without a checkpoint")
        _flush()
        os._exit(130)


def _ask(hook: Callable, default, within_s: float | None = None):
    """A watchdog hook's answer; its failure is logged and read as `default`, never ends the watchdog.
    `within_s`: the hook runs on a thread of its own and an answer later than that is `default` too
    (a store write to an agent that no longer answers blocks up to the store's 60 s timeout)."""
    name = getattr(hook, "__name__", hook)
    if within_s is not None:
        got = []
        t = threading.Thread(target=lambda: got.append(_ask(hook, default)), name="dflash-stop-hook",
                             daemon=True)
        t.start()
        t.join(within_s)
        if t.is_alive():
            log.warning("stop watchdog: %s did not return within %.0f s; going on without it", name, within_s)
            return default
        return got[0]
    try:
        return hook()
    except Exception as e:  # noqa: BLE001 - the watchdog must outlive a hook's bug
        log.warning("stop watchdog: %s failed (%s: %s)", name, type(e).__name__, e)
        return default


class StopAgreement:
    """Agree on a stop step over the control group (see the module docstring for the protocol)."""

    def __init__(self, stop: StopSignal | None, group, every: int, start: int, num_steps: int, live=None):
        self.stop, self.group, self.every = stop, group, max(1, every)
        self.live = live  # liveness watcher: bounds the blocking waits below (-1: every rank)
        self.start, self.num_steps = start, num_steps
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.pending = None
        self.stop_at: int | None = None

    def _is_check(self, c: int) -> bool:
        return self.start < c < self.num_steps and c % self.every == 0

    def _local(self) -> int:
        return int(self.stop is not None and self.stop.requested)

    def drafter_after(self, done: int) -> bool:
        """Drafter, after step `done`: True when the job stops here (checkpoint, then exit)."""
        if done == self.stop_at:
            return True
        if self._is_check(done):
            self.flag.fill_(self._local())
            with self._watch(done):
                dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
            if int(self.flag) and self.stop_at is None:
                self.stop_at = min(done + self.every, self.num_steps)
                log.warning("stop agreed: the job stops after step %d", self.stop_at)
        return False

    def target_before(self, step: int) -> bool:
        """Target, at the top of step `step`: True when the drafters stop before consuming it."""
        if not self._is_check(step):
            return False
        if self._wait():
            self.stop_at = step
            return True
        self.flag.fill_(self._local())
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return False

    def _wait(self) -> bool:
        if self.pending is None:
            return False
        with self._watch(None):
            self.pending.wait()
        self.pending = None
        return bool(int(self.flag))

    def finish(self) -> None:
        """Target, after its loop: complete the check still in flight (its drafters are joining it)."""
        self._wait()

    def _watch(self, step):
        if self.live is None:
            return contextlib.nullcontext()
        at = "" if step is None else f" after step {step}"
        return self.live.waiting(-1, f"the stop agreement{at}")


# ------------------------------------------------------------------------------------ data tally
class DataTally:
    """What a drafter consumed, on device (no host sync per step): documents, tokens and a
    checksum of (token, position) pairs, summed over a logging interval. Summed over drafters and
    logged per interval, it proves that no batch was skipped or repeated across a restart."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.docs = torch.zeros((), dtype=torch.int64, device=self.device)
        self.tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        self.checksum = torch.zeros((), dtype=torch.int64, device=self.device)

    def add(self, hb) -> None:
        valid = hb.doc_ids >= 0
        self.docs += (hb.doc_ids.max() + 1).clamp(min=0)
        self.tokens += valid.sum()
        self.checksum += ((hb.input_ids + 1) * (hb.position_ids + 1) * valid).sum()

    def pop(self) -> dict[str, torch.Tensor]:
        """Device tensors `data_{docs,tokens,checksum}`, for the trainer's one metric all-reduce."""
        out = {"data_docs": self.docs, "data_tokens": self.tokens, "data_checksum": self.checksum}
        self.reset()
        return out


def batch_tally(pb) -> dict[str, float]:
    """The same three numbers for one PackedBatch (test oracle, target logs)."""
    valid = pb.doc_ids >= 0
    return {"docs": float(pb.num_docs), "tokens": float(valid.sum()),
            "checksum": float(((pb.input_ids + 1) * (pb.position_ids + 1) * valid).sum())}


# ------------------------------------------------------------------------------------- fast exit
def fail_fast(exc: BaseException, role: str, rank: int) -> None:
    """Log the error naming this rank, leave it for torchrun's summary, and exit at once."""
    log.error("%s rank %d failed: %s: %s", role, rank, type(exc).__name__, exc, exc_info=exc)
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)
    except Exception:  # noqa: BLE001 - reporting must never keep a failed rank alive
        pass
    _flush()
    os._exit(1)


def _flush() -> None:
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:  # noqa: BLE001
            pass
