"""Same-node shared-memory transport on real processes: cleanup and peer death, and the CUDA IPC and
pinned-host slot variants (@pytest.mark.gpu). The scenarios every transport passes are in
test_transport.py."""

from __future__ import annotations

import os
import secrets
import signal
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import RankFailure, process_context, run_ranks
from transport_utils import check_backpressure, check_stream, make_batch, rank_stream, setup

from dflash_mp.transport import shm


def leftovers(pids) -> list[str]:
    """/dev/shm names created by any of `pids` (names carry the creator pid)."""
    prefixes = tuple(f"{shm.PREFIX}{pid}_" for pid in pids)
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefixes)]


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
