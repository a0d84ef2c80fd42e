"""Ranks that share one GPU take turns at it.

Two processes on one GPU never run kernels at the same time: the GPU time-slices between their CUDA
contexts while both have work queued, and every switch costs time. Taking turns, one rank queues a
whole unit of work (a target forward, a drafter step) and waits for the GPU to finish it before the
next rank queues its own, so each unit runs as it runs alone (BENCHMARKS.md measures both).

A turn is an exclusive `flock` on one file per GPU of the job. The kernel drops the lock of a rank
that dies, so a crash never leaves the others waiting on a turn nobody holds.

Targets go first. A target forward makes the data a drafter step needs, and a target can run at most
its ring's depth ahead (it waits for credit outside its turn), so a drafter never starves for a turn;
but a drafter that wins the turn from a waiting target may next wait for data while that target's
forward runs. `flock` has no order: a rank that frees the turn and asks again at once often beats the
rank it woke, and on a cold 8B job (BENCHMARKS.md, call Z5) the two ended up alternating with the
ring empty, the drafter waiting a whole forward for data every step. So a target holds a second lock,
the file's `.first` companion, shared, from asking for the turn until it has it, and a drafter takes
that lock exclusively (and lets it go) before asking: it waits while any target of its GPU is waiting.

A rank in its turn never waits on a turn that cannot end: a target forward waits on nobody, and a
drafter step waits (in its gradient all-reduce) only on drafters of other GPUs, whose turns come when
those GPUs' target forwards end. Two drafters on one GPU would each wait inside their all-reduce for
the turn the other holds, so such a GPU never takes turns. Waits for data (a target's send, a
drafter's receive) stay outside turns. `auto` takes turns where it was measured, a GPU whose drafter
is the job's only one (1 target + 1 drafter on one GPU); `on` also where several drafters on several
GPUs would hold their GPU's turn while their all-reduce waits on the others'.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile

import torch

from .topology import Topology

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"topology.gpu_turns={mode!r}: use auto (ranks sharing a GPU take turns at it on "
                         "CUDA), on or off.")
    return mode


def gpu_mates(topo: Topology, rank: int) -> list[int]:
    """The ranks on `rank`'s GPU, itself included (on CPU: the ranks of its node)."""
    gpu = topo.gpu_of(rank)
    if gpu is None:
        return [r for r in range(topo.world_size) if topo.node_of(r) == topo.node_of(rank)]
    return [r for r in range(topo.world_size) if topo.gpu_of(r) == gpu]


def decide(topo: Topology, mode: str, device: torch.device) -> tuple[bool, str]:
    """Whether `topo.rank` takes turns at its GPU, and why (for the log and the choices table)."""
    check_mode(mode)
    if mode == "off":
        return False, "off (topology.gpu_turns=off)"
    mates = gpu_mates(topo, topo.rank)
    if len(mates) < 2:
        return False, "off: the GPU is this rank's own"
    drafters = [r for r in mates if r in topo.drafter_ranks]
    if len(drafters) > 1:
        if mode == "on":
            raise ValueError(f"topology.gpu_turns=on: drafter ranks {drafters} share one GPU, and each would wait "
                             "inside its gradient all-reduce for a turn the other holds. Use topology.gpu_turns=auto "
                             "(off for such GPUs) or a split with one drafter rank per GPU.")
        return False, f"off: drafter ranks {drafters} share the GPU (their all-reduce cannot wait for a turn)"
    if mode == "auto" and device.type != "cuda":
        return False, "off: no GPU"
    if mode == "auto" and len(topo.drafter_ranks) > 1:
        # Measured where the GPU's drafter is the job's only one. With more, a drafter holds its turn
        # while its all-reduce waits for drafters still waiting for theirs: unmeasured, so not default.
        return False, ("off: the job has several drafters, whose all-reduce would hold this GPU's turn while "
                       "it waits on other GPUs' turns (not measured; topology.gpu_turns=on takes turns anyway)")
    return True, f"on: ranks {mates} share the GPU and take turns at it (topology.gpu_turns=off runs them at once)"


class GpuTurns:
    """One rank's side of its GPU's turns; a no-op where the rank does not take turns. `first`: this
    rank goes before ranks that are not first whenever it waits for a turn (a target; module doc)."""

    def __init__(self, path: str | None, device: torch.device, why: str = "", first: bool = False):
        self.path, self.device, self.why, self.first = path, device, why, first
        self.first_path = None if path is None else path + ".first"  # the lock a waiting first rank holds
        self._fd = self._first_fd = None
        if path is not None:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            self._first_fd = os.open(self.first_path, os.O_RDWR | os.O_CREAT, 0o600)

    @classmethod
    def for_rank(cls, topo: Topology, mode: str, device: torch.device, run_id: str | None) -> "GpuTurns":
        on, why = decide(topo, mode, device)
        mates = gpu_mates(topo, topo.rank)
        if len(mates) > 1 and topo.rank == min(mates):  # one line per shared GPU
            log.info("GPU turns %s", why)
        if not on:
            return cls(None, device, why)
        node, index = topo.node_of(topo.rank), (topo.gpu_of(topo.rank) or (0, 0))[1]
        job = run_id or f"agent{os.getppid()}"  # torchrun's agent: the parent of every local rank
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return cls(os.path.join(base, f"dflash_mp_turns_{job}_node{node}_gpu{index}"), device, why,
                   first=topo.rank not in topo.drafter_ranks)

    @property
    def active(self) -> bool:
        return self._fd is not None

    @contextlib.contextmanager
    def turn(self):
        """Hold the GPU for the body's work: wait for the turn, run the body, wait for the GPU to
        finish what it queued (every stream of this process), then pass the turn on."""
        if self._fd is None:
            yield
            return
        if self.first:  # waiting: ranks that are not first wait for us
            fcntl.flock(self._first_fd, fcntl.LOCK_SH)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            finally:
                fcntl.flock(self._first_fd, fcntl.LOCK_UN)
        else:  # no first rank waiting
            fcntl.flock(self._first_fd, fcntl.LOCK_EX)
            fcntl.flock(self._first_fd, fcntl.LOCK_UN)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is None:
            return
        os.close(self._fd)
        os.close(self._first_fd)
        self._fd = self._first_fd = None
        for path in (self.path, self.first_path):
            with contextlib.suppress(FileNotFoundError):  # every mate removes them; the first one wins
                os.unlink(path)
