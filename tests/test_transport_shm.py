"""Same-node shared-memory transport on real processes: the p2p scenarios again, plus cleanup and
peer death. CPU slots here; the CUDA IPC and pinned-host variants run under @pytest.mark.gpu."""

from __future__ import annotations

import os
import secrets
import signal
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import RankFailure, process_context, run_ranks
from test_transport_p2p import (
    check_backpressure,
    check_silent,
    check_stream,
    make_batch,
    rank_end_mismatch,
    rank_fan,
    rank_silent,
    rank_stream,
    setup,
)

from dflash_mp.transport import shm


def leftovers(pids) -> list[str]:
    """/dev/shm names created by any of `pids` (names carry the creator pid)."""
    prefixes = tuple(f"{shm.PREFIX}{pid}_" for pid in pids)
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefixes)]


# ---------------------------------------------------------------- the shared scenarios
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_stream_order_exact_slots_end(dtype_name):
    depth, n = 2, 60
    tgt, dft = check_stream(run_ranks(rank_stream, 2, "shm", n, depth, dtype_name, timeout=60), depth, n)
    assert tgt["stall_ms"] < 2000
    assert tgt["names"] == dft["names"] and tgt["names"][0].startswith(shm.PREFIX)


def test_backpressure_slow_consumer():
    depth, n, delay = 3, 12, 0.03
    results = run_ranks(rank_stream, 2, "shm", n, depth, "float32", delay, timeout=60)
    tgt, _ = check_stream(results, depth, n)
    check_backpressure(results, depth)
    assert max(tgt["in_flight"]) == depth
    assert tgt["stall_ms"] > 0.5 * (n - depth) * delay * 1e3


@pytest.mark.parametrize("num_targets", [1, 2], ids=["1to2", "2to1"])
def test_multiple_pairs(num_targets):
    results = run_ranks(rank_fan, 3, "shm", num_targets, 20, timeout=60)
    if num_targets == 1:
        assert results[0]["sent"] == {1: 20, 2: 20}
        assert results[1]["received"] == {0: 20} and results[2]["received"] == {0: 20}
    else:
        assert results[2]["received"] == {0: 10, 1: 10}


@pytest.mark.parametrize("silent_role", ["target", "drafter"])
def test_timeout_names_the_silent_peer(silent_role):
    timeout_s = 1.0
    results = run_ranks(rank_silent, 2, "shm", silent_role, timeout_s, timeout_s + 1.0, timeout=30)
    text = "no data from target rank 0" if silent_role == "target" else "no credit from drafter rank 1"
    check_silent(results, silent_role, timeout_s, text)


def test_end_of_data_mismatches():
    results = run_ranks(rank_end_mismatch, 2, "shm", 2, 3, timeout=60, allow_failures=True)
    assert "recv 2" in results[1] and "end-of-data at seq 2" in results[1]
    results = run_ranks(rank_end_mismatch, 2, "shm", 3, 2, timeout=60, allow_failures=True)
    assert "expect_end" in results[1] and "expected end-of-data" in results[1]
    assert isinstance(results[0], RankFailure) and "drafter rank 1" in results[0].error


# ---------------------------------------------------------------- cleanup and peer death
def rank_fail(rank, world, who, how, after):
    """Run a pair until `who` fails `how` at batch `after`; the survivor must raise naming it."""
    topo, tr = setup(rank, world, 1, "shm", timeout_s=30.0)  # death must be noticed long before this
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    name = tr._channels[1 - rank].segment_name
    assert not os.path.exists(f"/dev/shm/{name}"), "segment name still linked after setup"
    with tr:
        t0 = time.monotonic()
        try:
            for seq in range(40):
                if topo.role == who and seq == after:
                    if how == "raise":
                        raise ValueError("injected failure")
                    os.kill(os.getpid(), {"kill": signal.SIGKILL, "term": signal.SIGTERM}[how])
                    time.sleep(30)
                t0 = time.monotonic()
                if topo.role == "target":
                    tr.send(1, make_batch(0, 1, seq))
                else:
                    tr.recv(0)
        except RuntimeError as e:
            return {"pids": pids, "error": str(e), "detect_s": time.monotonic() - t0}
    return {"pids": pids, "error": None}


@pytest.mark.parametrize(
    "who,how",
    [("drafter", "raise"), ("target", "raise"), ("target", "kill"), ("drafter", "kill"), ("drafter", "term")],
)
def test_peer_failure_is_named_and_nothing_leaks(who, how):
    results = run_ranks(rank_fail, 2, who, how, 5, timeout=60, allow_failures=True)
    failed, survivor = (results[0], results[1]) if who == "target" else (results[1], results[0])
    assert isinstance(failed, RankFailure)
    if how == "raise":
        assert "injected failure" in failed.error
    else:
        assert failed.exitcode == -{"kill": signal.SIGKILL, "term": signal.SIGTERM}[how]
    peer = "target rank 0" if who == "target" else "drafter rank 1"
    assert peer in survivor["error"], survivor["error"]
    assert ("died" if how != "raise" else "stopped early") in survivor["error"], survivor["error"]
    assert survivor["detect_s"] < 5.0
    assert leftovers(survivor["pids"]) == []


def _create_then(how: str, token: str) -> None:
    """Child: create a segment, then leave before setup would have unlinked it."""
    shm.create_segment(f"{shm.PREFIX}{os.getpid()}_{token}", 4096)
    if how == "raise":
        raise ValueError("injected failure inside the setup window")
    os.kill(os.getpid(), {"term": signal.SIGTERM, "kill": signal.SIGKILL}[how])
    time.sleep(30)


@pytest.mark.parametrize("how", ["raise", "term", "kill"])
def test_setup_window_cleanup(how):
    """Names still linked when a creator fails: removed at exit (exception), by the SIGTERM hook,
    or, after SIGKILL, by sweep_stale_segments (the name's pid is dead)."""
    token = f"test_{secrets.token_hex(4)}"
    p = process_context(_create_then).Process(target=_create_then, args=(how, token))
    p.start()
    p.join(60)
    path = f"/dev/shm/{shm.PREFIX}{p.pid}_{token}"
    assert p.exitcode == {"raise": 1, "term": -signal.SIGTERM, "kill": -signal.SIGKILL}[how]
    if how == "kill":
        assert os.path.exists(path)
        assert os.path.basename(path) in shm.sweep_stale_segments()
    assert not os.path.exists(path)


def test_sweep_keeps_live_segments():
    name = f"{shm.PREFIX}{os.getpid()}_test_{secrets.token_hex(4)}"
    seg = shm.create_segment(name, 4096)
    try:
        assert name not in shm.sweep_stale_segments()
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        seg.close()
        shm.unlink_segment(name)
    assert not os.path.exists(f"/dev/shm/{name}")


# ---------------------------------------------------------------- GPU variants
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shm_cuda", ["ipc", "pinned"])
def test_cuda_stream(shm_cuda):
    depth, n = 2, 60
    cfg, kw = {"shm_cuda": shm_cuda}, {"timeout": 180, "start_method": "spawn"}
    results = run_ranks(rank_stream, 2, "shm", n, depth, "bfloat16", 0.0, "cuda", cfg, **kw)
    check_stream(results, depth, n)
    results = run_ranks(rank_stream, 2, "shm", 12, 3, "bfloat16", 0.03, "cuda", cfg, **kw)
    check_backpressure(results, 3)
