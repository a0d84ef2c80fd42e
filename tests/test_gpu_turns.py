"""Ranks sharing a GPU take turns at it (gpu_turns.py): who does, that turns exclude each other
across real processes, also after a holder dies, that a waiting target goes first, and that the
target packs its next batch inside its turn. The job's own use of turns is checked end to end in
test_e2e (1 target + 1 drafter with topology.gpu_turns=on equals the one-process reference)."""

import dataclasses
import fcntl
import itertools
import multiprocessing as mp
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from dflash_mp.gpu_turns import GpuTurns, decide
from dflash_mp.roles import TargetRun
from dflash_mp.topology import Topology

CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # only their type is read: no GPU needed


def topo(targets: int, rank: int, world: int, gpus: int) -> Topology:
    return dataclasses.replace(Topology.plan(targets, rank, world), gpus_per_node=gpus)


def test_a_target_and_a_drafter_on_one_gpu_take_turns_by_default():
    for rank in (0, 1):
        on, why = decide(topo(1, rank, 2, gpus=1), "auto", CUDA)
        assert on and "ranks [0, 1] share the GPU" in why
    assert not decide(topo(1, 0, 2, gpus=1), "off", CUDA)[0]
    assert not decide(topo(1, 0, 2, gpus=2), "auto", CUDA)[0]  # each rank owns its GPU
    assert not decide(topo(1, 0, 2, gpus=0), "auto", CPU)[0]  # auto: CUDA only
    assert decide(topo(1, 0, 2, gpus=0), "on", CPU)[0]  # on: the node's ranks (how the CPU tests run it)


def test_two_drafters_on_one_gpu_never_take_turns():
    # 1 target + 2 drafters on one GPU: a drafter holding the turn in its all-reduce would wait
    # for the other, which waits for the turn.
    on, why = decide(topo(1, 1, 3, gpus=1), "auto", CUDA)
    assert not on and "drafter ranks [1, 2]" in why
    with pytest.raises(ValueError, match=r"topology.gpu_turns=on: drafter ranks \[1, 2\] share one GPU"):
        decide(topo(1, 1, 3, gpus=1), "on", CUDA)
    # 4 ranks on 2 GPUs: (0, 2) and (1, 3), one target and one drafter each: turns only when asked
    # for (a drafter would hold its GPU's turn while its all-reduce waits on the other GPU's).
    on, why = decide(topo(2, 3, 4, gpus=2), "auto", CUDA)
    assert not on and "several drafters" in why
    assert decide(topo(2, 3, 4, gpus=2), "on", CUDA)[0]


def test_running_out_of_memory_names_the_layout_and_the_fix():
    from dflash_mp.config import JobConfig
    from dflash_mp.main import explain_oom

    def oom():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 340.00 MiB.")
        except torch.OutOfMemoryError as e:
            return e

    e = oom()
    out = explain_oom(e, topo(1, 0, 2, gpus=1))  # the 27B preset's 1 + 1 on one 80 GB card
    assert isinstance(out, torch.OutOfMemoryError) and out.__cause__ is e
    assert out.__traceback__ is e.__traceback__  # the rank's log keeps where it ran out
    msg = str(out)
    assert "GPU 0 of node 0 holds 2 processes (target rank 0, drafter rank 1)" in msg
    assert "give each process a GPU of its own (this node has 1 for 2 processes)" in msg
    assert msg.endswith("CUDA out of memory. Tried to allocate 340.00 MiB.")
    # 4 ranks on 2 GPUs: rank 3 shares GPU 1 with rank 1
    assert "holds 2 processes (target rank 1, drafter rank 3)" in str(explain_oom(oom(), topo(2, 3, 4, gpus=2)))
    # Out of memory handed on: a CUDA call's error, or another error raised from the allocator's.
    assert "holds 2 processes" in str(explain_oom(RuntimeError("CUDA error: out of memory"), topo(1, 1, 2, gpus=1)))
    try:
        raise RuntimeError("backend compiler failed") from e
    except RuntimeError as wrapped:
        assert "holds 2 processes" in str(explain_oom(wrapped, topo(1, 1, 2, gpus=1)))
    # A target alone on its GPU: its layers need more GPUs.
    alone = str(explain_oom(e, topo(1, 0, 2, gpus=2)))
    assert ("target rank 0 has GPU 0 of node 0 to itself and its share of the target's layers does not fit: split "
            "the target over more GPUs with a larger target.stages (now 1;") in alone
    # A drafter alone on its GPU: the knobs of its step's memory, the one that keeps the training first.
    job = JobConfig()
    job.drafter.loss_chunk_size, job.drafter.num_anchors, job.data.seq_len = 4096, 512, 3072
    drafter = str(explain_oom(e, topo(1, 1, 2, gpus=2), job))
    assert ("drafter rank 1 has GPU 1 of node 0 to itself and its training step does not fit: lower "
            "drafter.loss_chunk_size (now 4096; the same training") in drafter
    assert "drafter.num_anchors (now 512) or data.seq_len (now 3072)" in drafter
    # Without the job's knobs, CPU ranks, or another error: unchanged.
    for t, err in ((topo(1, 1, 2, gpus=2), e), (topo(1, 0, 2, gpus=0), e), (topo(1, 0, 2, gpus=1), ValueError("x"))):
        assert explain_oom(err, t) is err
    other = ValueError("x")
    assert explain_oom(other, topo(1, 1, 2, gpus=2), job) is other


def test_a_bad_value_names_itself_and_the_choices():
    with pytest.raises(ValueError, match=r"topology.gpu_turns='yes': use auto .*, on or off"):
        decide(topo(1, 0, 2, gpus=1), "yes", CUDA)


def _hold_turns(path: str, n: int, hold_s: float, out, barrier) -> None:
    turns = GpuTurns(path, CPU) if path else GpuTurns(None, CPU)
    barrier.wait()
    for _ in range(n):
        with turns.turn():
            t0 = time.monotonic()
            time.sleep(hold_s)
            out.put((os.getpid(), t0, time.monotonic()))
        time.sleep(0.001)  # the next turn is free to go to the other process


def _spans(path: str | None, procs: int = 2, n: int = 8, hold_s: float = 0.02) -> list[tuple]:
    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(procs)
    ps = [ctx.Process(target=_hold_turns, args=(path, n, hold_s, out, barrier)) for _ in range(procs)]
    for p in ps:
        p.start()
    spans = [out.get(timeout=60) for _ in range(procs * n)]
    for p in ps:
        p.join(timeout=30)
        assert p.exitcode == 0
    return sorted(spans, key=lambda s: s[1])


def _overlaps(spans) -> int:
    return sum(1 for a, b in zip(spans, spans[1:]) if b[1] < a[2] and a[0] != b[0])


def test_turns_exclude_each_other_across_processes(tmp_path):
    spans = _spans(str(tmp_path / "gpu0"))
    assert len({s[0] for s in spans}) == 2  # both processes held turns
    assert _overlaps(spans) == 0, spans
    # Without turns the same processes do overlap: the check above can see a broken lock.
    assert _overlaps(_spans(None)) > 0


def _hold_forever(path: str, ready) -> None:
    turns = GpuTurns(path, CPU)
    with turns.turn():
        ready.set()
        time.sleep(600)


def test_a_holder_that_dies_frees_the_turn(tmp_path):
    path = str(tmp_path / "gpu0")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_forever, args=(path, ready))
    p.start()
    assert ready.wait(60)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    turns = GpuTurns(path, CPU)
    t0 = time.monotonic()
    with turns.turn():
        pass
    assert time.monotonic() - t0 < 5
    turns.close()
    assert not os.path.exists(path)  # the last one out removes the file


def _target_asks(path: str, n: int, ask, asked, count) -> None:
    turns = GpuTurns(path, CPU, first=True)
    for _ in range(n):
        ask.acquire()
        asked.release()
        with turns.turn():
            count.value += 1
    turns.close()


def test_a_waiting_target_goes_before_a_drafter_that_asks_again(tmp_path):
    # The drafter frees the turn while the target waits for it, and asks again at once (its next
    # batch is in the ring). flock alone often hands it back to the drafter; the target must go first
    # every time, or a drafter can end up waiting for data while the target's forward runs.
    path, n = str(tmp_path / "gpu0"), 10
    ctx = mp.get_context("spawn")
    ask, asked, count = ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("i", 0)
    p = ctx.Process(target=_target_asks, args=(path, n, ask, asked, count))
    p.start()
    drafter, seen = GpuTurns(path, CPU), []
    probe = os.open(drafter.first_path, os.O_RDWR | os.O_CREAT)

    def target_waits() -> bool:  # it holds `.first` from asking for the turn until it has it
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(probe, fcntl.LOCK_UN)
        return False

    try:
        for i in range(n + 1):
            with drafter.turn():
                seen.append(count.value)
                if seen[-1] != i or i == n:  # the drafter went twice in a row, or the rounds are done
                    break
                ask.release()
                assert asked.acquire(timeout=60)
                deadline = time.monotonic() + 2  # code without the order never shows the wait
                while not target_waits() and time.monotonic() < deadline:
                    time.sleep(0.001)
    finally:
        p.join(10)
        if p.is_alive():  # it waits to be asked again
            p.terminate()
            p.join()
        drafter.close()
        os.close(probe)
    assert seen == list(range(n + 1))  # each time the target's turn came between the drafter's two
    assert p.exitcode == 0


def test_ranks_of_a_shared_gpu_know_who_goes_first():
    run_id = f"first{os.getpid()}"
    target, drafter = (GpuTurns.for_rank(topo(1, r, 2, gpus=0), "on", CPU, run_id) for r in (0, 1))
    try:
        assert target.first and target.active and not drafter.first and drafter.active
        assert target.path == drafter.path
    finally:
        target.close()
        drafter.close()
    assert not os.path.exists(target.path) and not os.path.exists(target.first_path)


@pytest.mark.parametrize("rows", [1, 2])
def test_the_target_packs_its_next_batch_inside_its_turn(tmp_path, rows):
    # TargetRun's loop with the model and the transport left out: the next forward's batches (`rows` of
    # them, target.rows_per_forward) are packed while the turn is held (the GPU runs the forward
    # meanwhile), so nothing separates the send from asking for the next turn; and no batch is packed
    # past the last forward.
    path = str(tmp_path / "gpu0")
    probe, held = os.open(path, os.O_RDWR | os.O_CREAT), []

    def batches():
        for i in itertools.count():
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(probe, fcntl.LOCK_UN)
                held.append(False)
            except BlockingIOError:
                held.append(True)
            yield i

    run, sent = TargetRun.__new__(TargetRun), []
    run.turns = GpuTurns(path, CPU, first=True)
    run.batches, run.ahead, run.forwards, run.num_forwards = batches(), [], 1, 1 + 3 * rows  # forward 0 compiled
    run.rows_per_forward, run.ready = rows, []
    run.stream = object()
    run.worker = SimpleNamespace(forward_rows=lambda rows, width: [("states", pb) for pb in rows])
    run.sender = SimpleNamespace(send=lambda dst, hb: sent.append((dst, hb)))
    run.metrics = SimpleNamespace(update=lambda pb, data: None)
    try:
        for step in range(1, 1 + 3 * rows):
            run.send(7, None, step)  # a first stage's: the next data row
    finally:
        run.turns.close()
        os.close(probe)
    assert sent == [(7, ("states", i)) for i in range(3 * rows)]
    # the first forward's batches came before any turn; none after the last
    assert held == [False] * rows + [True] * (2 * rows)
