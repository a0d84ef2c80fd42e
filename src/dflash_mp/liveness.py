"""Busy is not dead: every rank publishes a heartbeat with its phase, and every rank watches all others.

A daemon thread per rank writes a beat to the job's store once per `interval_s`: a counter, the
phase the rank is in (`starting`, `loading`, `compiling`, `training`, `checkpointing`, `done`, ...),
how long it has been in it, and what its main thread is blocked on. The same thread reads every
other rank's beat (one `multi_get`) and ends the process, naming the rank at fault, when

* a rank's counter has not moved for `stale_s` (observer's clock: works across nodes): dead or
  frozen (SIGKILL, SIGSTOP, a lost node);
* a rank has been in a bounded phase longer than its bound (loading, compiling, checkpointing,
  evaluating, starting each have one): stuck while alive;
* a rank reported that it failed (its reason is quoted, so the root cause reaches every survivor).
  A rank whose failure was a peer's end seen from its side (a closed connection, `peer_error`) marks it
  a consequence: a dead, frozen or stuck rank, or another rank's own failure, is named before it;
* this rank's main thread has waited on a peer for data or credit for `wait_s` counted only while
  no rank of the job was in a busy phase: a drafter compiling for minutes pauses every data wait,
  a peer that is merely slow does not.

The thread runs on its own store connection, so a main thread blocked inside a store wait (group
creation) or a C++ collective (gloo) cannot hold it up, and it `os._exit`s, which works however the
main thread is stuck. Transports and collectives keep their own deadlines only where no watcher
exists (unit tests that build channels directly).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from .fsutil import pid_alive

log = logging.getLogger(__name__)

BUSY = ("starting", "loading", "compiling", "checkpointing", "evaluating")
DONE, FAILED = "done", "failed"


@dataclass
class LivenessConfig:
    # Seconds between two beats of a rank; 0 = auto: min(1, stale/6).
    interval_s: float = 0.0
    # A rank whose beat has not moved this long is dead or frozen. 0 = auto: transport.timeout_s.
    stale_s: float = 0.0
    # Bounds of the busy phases (seconds): a rank longer in one is stuck. Sized for a 27B target on a
    # cold node: weights from network storage, a cold Inductor compile of every graph.
    starting_s: float = 900.0  # process groups, communicators, transport set-up
    loading_s: float = 3600.0  # data tokenizing, target weights, the drafter's frozen head
    compiling_s: float = 2400.0  # first steps of a role: torch.compile, autotuning, CUDA graph capture
    checkpointing_s: float = 1800.0
    evaluating_s: float = 3600.0


_HOST = socket.gethostname()


_IMPORTED = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (interpreter and imports included), from /proc where
    there is one."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def peer_error(e: BaseException) -> bool:
    """Does this error look like a peer's end seen from here (rather than a fault of this rank)?"""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, getattr(dist, "DistError", ())) or any(s in text for s in (
        "Connection closed", "Connection reset", "closed its channel", "stopped early", "died",
        "no data from", "no credit from", "Broken pipe", "p2p with"))


def _exit(code: int) -> None:
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


JOIN_S = 2.0  # how long done() waits for the watcher to leave a store call (a read takes milliseconds)


class Liveness:
    """This rank's heartbeat and watcher. `names[r]` is how rank r is named in messages."""

    def __init__(self, store, rank: int, world_size: int, names: dict[int, str], cfg: LivenessConfig,
                 wait_s: float, exit_fn=_exit):
        self.store, self.rank, self.world = store, rank, world_size
        self.names = names
        self.stale_s = cfg.stale_s or wait_s
        self.interval_s = cfg.interval_s or min(1.0, self.stale_s / 6)
        self.bounds = {p: getattr(cfg, f"{p}_s") for p in BUSY}
        self.wait_s = wait_s
        self._exit = exit_fn
        self._lock = threading.Lock()
        self._phase, self._detail, self._since = "starting", "", time.monotonic()
        self._step = -1
        self._trained = False  # a drafter that has finished a step in this attempt
        self._wait: dict | None = None  # {"peer", "what", "since", "quiet"}: the main thread's wait
        self._reason = ""
        self._consequence = False  # the reason is a peer's end seen from here (failed(consequence=True))
        self._count = 0
        self._seen: dict[int, tuple[int, float, int]] = {}  # rank -> (count, when it changed, my ticks)
        self._ticks = 0
        self._present: set[int] = set()
        self._beats: dict[int, dict | None] = {}  # every rank's last beat, as the watcher last read them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------- main thread
    def start(self) -> "Liveness":
        self._beat()
        self._thread = threading.Thread(target=self._run, name="dflash-liveness", daemon=True)
        self._thread.start()
        return self

    def phase(self, name: str, detail: str = "") -> None:
        """Enter a phase; a bounded one (see BUSY) starts its clock now."""
        with self._lock:
            if (name, detail) != (self._phase, self._detail):
                self._phase, self._detail, self._since = name, detail, time.monotonic()

    @contextmanager
    def during(self, name: str, detail: str = ""):
        """A busy phase around a block, then back to the phase before it."""
        prev = (self._phase, self._detail)
        self.phase(name, detail)
        try:
            yield
        finally:
            self.phase(*prev)

    def step(self, step: int) -> None:
        self._step = step

    def trained(self) -> None:
        """A drafter finished its first step of this attempt: a stop from now on has a step to save."""
        self._trained = True

    @contextmanager
    def waiting(self, peer: int, what: str, timeout_msg: str = ""):
        """The main thread is blocked on `peer` for `what` (e.g. "batch 3"); `timeout_msg` is the
        error when that wait outlives `wait_s` of quiet time."""
        with self._lock:
            self._wait = {"peer": peer, "what": what, "since": time.monotonic(), "quiet": 0.0,
                          "msg": timeout_msg}
        try:
            yield
        finally:
            with self._lock:
                self._wait = None

    def done(self) -> None:
        self._stop.set()
        self.phase(DONE)
        self._beat(landed=True)
        self._join()

    def _join(self) -> None:
        """Wait, bounded, for the watcher to leave the store call it may be in: the process then ends
        with no thread inside the store's C++ client (a daemon thread there while the interpreter
        finalizes is one way a process can abort at exit). A store that no longer answers (the agent
        gone) holds the exit up by at most JOIN_S, within the stop watchdog's bound on this hook
        (resilience.CLEAN_EXIT_HOOK_S)."""
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=JOIN_S)

    def settle(self) -> None:
        """After a peer-related error on the main thread: wait long enough for the watcher to see
        a dead peer's beat go stale; it names that rank and exits the process if it does."""
        deadline = time.monotonic() + self.stale_s + 3 * self.interval_s
        while time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(self.interval_s / 2)

    def failed(self, reason: str, consequence: bool = False) -> None:
        """Tell every peer why this rank is about to exit (they quote it). `consequence`: the error was a
        peer's end seen from here (`peer_error`) that the watcher did not trace to a rank in `settle()`;
        a watcher then names a dead, frozen or stuck rank, or another's own failure, before quoting it."""
        self._stop.set()
        with self._lock:
            self._phase, self._reason, self._consequence = FAILED, reason[:400], consequence
        try:
            self._beat(landed=True)
        except Exception:  # noqa: BLE001 - the store may be gone with the agent
            pass

    def peers_in(self, phase: str) -> list[str]:
        """The other ranks whose last beat puts them in `phase` (e.g. checkpointing), described.
        Any thread: a stop's watchdog asks it before ending a rank that waits for them."""
        with self._lock:
            beats = dict(self._beats)
        return [self.describe(r, b) for r, b in sorted(beats.items())
                if r != self.rank and b is not None and b["phase"] == phase]

    def none_trained(self, ranks: list[int]) -> bool:
        """No rank of `ranks` (the drafters) has finished a step in this attempt (`trained`): each is
        still before or inside its first step (starting, loading, the first compile), this rank from
        its own state, the others from their last beats (up to one interval late). A stop then has
        nothing to save beyond the checkpoint the attempt started from. Any thread: a stop's watchdog
        asks it before ending the rank."""
        with self._lock:
            beats = dict(self._beats)
            beats[self.rank] = {"trained": self._trained}
        return not any(beats.get(r) is not None and beats[r].get("trained") for r in ranks)

    # ----------------------------------------------------------------------------- the thread
    def _payload(self) -> dict:
        now = time.monotonic()
        with self._lock:
            w = self._wait
            return {"n": self._count, "host": _HOST, "pid": os.getpid(), "phase": self._phase, "detail": self._detail,
                    "age": round(now - self._since, 1), "step": self._step, "trained": self._trained,
                    "reason": self._reason, "consequence": self._consequence,
                    "wait": None if w is None else {"peer": w["peer"], "what": w["what"],
                                                    "for": round(now - w["since"], 1)}}

    def _beat(self, landed: bool = False) -> None:
        """Publish this rank's state. `landed`: return only once the store holds it (the last beat
        before the process exits, FAILED or DONE). A TCPStore's set is not answered, so the process
        could exit, and a peer see its pid gone, before the store has the beat that explains it; a
        read on the same connection is answered after every earlier request of that connection."""
        self._count += 1
        key = f"hb/{self.rank}"
        self.store.set(key, json.dumps(self._payload()))
        if landed:
            try:
                self.store.get(key)
            except Exception as e:  # noqa: BLE001 - the store gone after the set: exiting anyway
                log.debug("liveness: store unreachable (%s)", e)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                beats = self._read()
            except Exception as e:  # noqa: BLE001 - the store is gone: the agent is tearing down
                log.debug("liveness: store unreachable (%s)", e)
                continue
            with self._lock:
                self._beats = beats
            now = time.monotonic()
            problem = self.problem(beats, now, now - last)
            last = now
            if problem and not self._stop.is_set():
                self._fatal(problem)

    def problem(self, beats: dict[int, dict | None], now: float, dt: float) -> str | None:
        """check(beats), confirmed against the beats as they are now. A rank that fails writes its
        reason and then exits (one that ends cleanly, DONE): its pid can be gone by the time check()
        looks while `beats` were read before that write. Read again, so that a survivor quotes the
        first failure instead of naming the rank that relayed it as dead, and lets a finished one be."""
        seen = self.check(beats, now, dt)
        if seen is None:
            return None
        try:
            fresh = self._read()
        except Exception as e:  # noqa: BLE001 - the store is gone: the agent is tearing down
            log.debug("liveness: store unreachable (%s)", e)
            return seen
        return self.check(fresh, time.monotonic(), 0.0)

    def _read(self) -> dict[int, dict | None]:
        """Every rank's last beat (None: not started yet). A rank's key, once written, stays."""
        for r in range(self.world):
            if r not in self._present and self.store.check([f"hb/{r}"]):
                self._present.add(r)
        ranks = sorted(self._present)
        vals = self.store.multi_get([f"hb/{r}" for r in ranks]) if ranks else []
        beats: dict[int, dict | None] = dict.fromkeys(range(self.world))
        beats.update({r: json.loads(bytes(v).decode()) for r, v in zip(ranks, vals)})
        return beats

    def describe(self, r: int, b: dict) -> str:
        what = b["phase"] + (f" ({b['detail']})" if b.get("detail") else "")
        step = f", step {b['step']}" if b.get("step", -1) >= 0 else ""
        return f"{self.names.get(r, f'rank {r}')} [{what} for {b['age']:.0f} s{step}]"

    def check(self, beats: dict[int, dict | None], now: float, dt: float) -> str | None:
        """The first reason to end the job seen in `beats`, or None. Pure but for the staleness
        bookkeeping, so tests can drive it with made-up beats. A rank's own failure comes first, whatever
        its rank (the ranks that torchrun's teardown ends after it die as a consequence), a failure
        marked a consequence last."""
        self._ticks += 1
        busy = False
        relayed = None  # the first failure marked a consequence: quoted if nothing else explains the end
        for r, b in beats.items():
            if r != self.rank and b is not None and b["phase"] == FAILED and not b.get("consequence"):
                return self._failure(r, b)
        for r, b in beats.items():
            if r == self.rank:
                b = self._payload()
            elif b is None:  # not started yet: torchrun started it, so it joins within `starting_s`
                seen = self._seen.setdefault(r, (-1, now, self._ticks))
                if now - seen[1] > self.bounds["starting"]:
                    return f"{self.names.get(r, f'rank {r}')} never started its heartbeat in {now - seen[1]:.0f} s"
                busy = True
                continue
            if b["phase"] == FAILED:
                relayed = relayed or self._failure(r, b)
                continue
            if b["phase"] == DONE:
                continue
            if r != self.rank:
                if b.get("host") == _HOST and not pid_alive(b.get("pid", 0)):
                    return f"{self.describe(r, b)} died (pid {b['pid']} is gone)"
                count, since, ticks = self._seen.get(r, (None, now, self._ticks))
                if count != b["n"]:
                    self._seen[r] = (b["n"], now, self._ticks)
                elif now - since > self.stale_s and self._ticks - ticks >= 3:
                    return (f"{self.describe(r, b)} has not beaten for {now - since:.0f} s "
                            f"(liveness bound {self.stale_s:.0f} s): dead or frozen")
            bound = self.bounds.get(b["phase"])
            if bound is not None:
                busy = True
                if b["age"] > bound:
                    return (f"{self.describe(r, b)} is stuck: over liveness.{b['phase']}_s={bound:.0f}; "
                            f"raise it if that phase is legitimately slower")
        if relayed is not None:
            return relayed
        with self._lock:
            w = self._wait
            if w is not None and not busy:
                w["quiet"] += dt
            if w is not None and busy and not w.get("noted") and now - w["since"] > self.wait_s:
                w["noted"] = True  # once per wait: why a long wait is not an error
                who = [self.describe(r, b) for r, b in beats.items()
                       if b is not None and r != self.rank and b["phase"] in self.bounds]
                log.info("%s: waiting %.0f s for %s from %s; not an error while busy: %s",
                         self.names.get(self.rank), now - w["since"], w["what"],
                         self.names.get(w["peer"], "every rank"), "; ".join(who) or "starting peers")
            if w is not None and w["quiet"] > self.wait_s:
                peer = w["peer"]
                # A wait that began before a peer froze runs out first: name the silent peer as the
                # staleness rule would a moment later, not as a slow one.
                silences = {r: self._silent_s(r, beats.get(r), now) for r in (beats if peer < 0 else [peer])}
                for r, silent in silences.items():
                    if silent >= 2 * self.interval_s:
                        return (f"{self.describe(r, beats[r])} has not beaten for {silent:.0f} s while "
                                f"{self.names.get(self.rank)} waited {w['quiet']:.0f} s for {w['what']}: "
                                f"dead or frozen")
                # A beat one interval late is a rank that froze just now or a slow one: the next tick
                # tells them apart (for at most two intervals past the bound).
                if w["quiet"] <= self.wait_s + 2 * self.interval_s and max(silences.values()) >= self.interval_s:
                    return None
                if peer < 0:  # a collective of every rank: name the ranks furthest behind
                    live = {r: b for r, b in beats.items() if b is not None and b["phase"] != DONE}
                    low = min((b["step"] for b in live.values()), default=-1)
                    state = "; ".join(self.describe(r, b) for r, b in live.items() if b["step"] == low)
                    return (f"{self.names.get(self.rank)} waited {w['quiet']:.0f} s for {w['what']}; "
                            f"furthest behind: {state} (transport.timeout_s={self.wait_s:.0f})")
                head = w["msg"] or f"waited {w['quiet']:.0f} s for {w['what']} from {self.names.get(peer)}"
                # The peer may itself be waiting (a staged target's later stage waits for the one
                # before it): follow the waits to the rank that holds everything up, and name it.
                chain, seen = [], {self.rank}
                while peer not in seen and (beats.get(peer) or {}).get("wait"):
                    seen.add(peer)
                    nxt = beats[peer]["wait"]
                    if nxt["peer"] < 0 or nxt["peer"] in seen:
                        break
                    chain.append(f"{self.names.get(peer)} waits for {nxt['what']} from {self.names.get(nxt['peer'])}")
                    peer = nxt["peer"]
                    silent = self._silent_s(peer, beats.get(peer), now)
                    if silent >= 2 * self.interval_s:
                        return (f"{head}; {'; '.join(chain)}, which has not beaten for {silent:.0f} s: dead or "
                                f"frozen: {self.describe(peer, beats[peer])}")
                pb = beats.get(peer)
                state = self.describe(peer, pb) if pb else self.names.get(peer, f"rank {peer}")
                via = "".join(f"; {c}" for c in chain)
                return f"{head}{via}; it is alive: {state} (transport.timeout_s={self.wait_s:.0f})"
        return None

    def _failure(self, r: int, b: dict) -> str:
        """A FAILED beat's reason (it starts with the rank's own name)."""
        return b.get("reason") or f"{self.names.get(r, f'rank {r}')} failed (see its log)"

    def _silent_s(self, r: int, b: dict | None, now: float) -> float:
        """Seconds since rank `r`'s beat last moved, as this watcher saw it (0: moving or unknown)."""
        if r == self.rank or b is None or b["phase"] in (DONE, FAILED) or r not in self._seen:
            return 0.0
        count, since, _ = self._seen[r]
        return now - since if count == b["n"] else 0.0

    def _fatal(self, problem: str) -> None:
        me = self.names.get(self.rank, f"rank {self.rank}")
        log.error("%s failed: %s", me, problem)
        self.failed(f"{me} failed: {problem}")
        self._exit(1)


class NullLiveness:
    """Where no watcher runs (tests that build one role's parts directly)."""

    def phase(self, name: str, detail: str = "") -> None:
        pass

    @contextmanager
    def during(self, name: str, detail: str = ""):
        yield

    def step(self, step: int) -> None:
        pass

    def trained(self) -> None:
        pass

    @contextmanager
    def waiting(self, peer: int, what: str, timeout_msg: str = ""):
        yield

    def done(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def failed(self, reason: str) -> None:
        pass
