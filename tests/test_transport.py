"""The scenarios every transport must pass, on real gloo processes: torch.distributed point-to-point
(`p2p`) and the same-node shared-memory ring (`shm`, CPU slots; its CUDA variants are in
test_transport_shm.py)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import RankFailure, run_ranks
from transport_utils import (
    H,
    T,
    check_backpressure,
    check_silent,
    check_stream,
    rank_end_mismatch,
    rank_fan,
    rank_silent,
    rank_stream,
)

from dflash_mp.transport import shm

KINDS = ["p2p", "shm"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_stream_order_exact_slots_end(kind, dtype_name):
    depth, n = 2, 60
    tgt, dft = check_stream(run_ranks(rank_stream, 2, kind, n, depth, dtype_name, timeout=60), depth, n)
    assert tgt["bytes_sent"] == n * (4 + 4 * T) * 8 + n * T * H * getattr(torch, dtype_name).itemsize
    assert tgt["stall_ms"] < 2000  # a consumer that keeps up barely stalls the target
    if kind == "shm":
        assert tgt["names"] == dft["names"] and tgt["names"][0].startswith(shm.PREFIX)


@pytest.mark.parametrize("kind", KINDS)
def test_backpressure_slow_consumer(kind):
    depth, n, delay = 3, 12, 0.03
    results = run_ranks(rank_stream, 2, kind, n, depth, "float32", delay, timeout=60)
    tgt, _ = check_stream(results, depth, n)
    check_backpressure(results, depth)
    assert max(tgt["in_flight"]) == depth
    assert tgt["stall_ms"] > 0.5 * (n - depth) * delay * 1e3  # the target waited for the slow drafter


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_targets", [1, 2], ids=["1to2", "2to1"])
def test_multiple_pairs(kind, num_targets):
    results = run_ranks(rank_fan, 3, kind, num_targets, 20, timeout=60)
    if num_targets == 1:
        assert results[0]["sent"] == {1: 20, 2: 20}
        assert results[1]["received"] == {0: 20} and results[2]["received"] == {0: 20}
    else:
        assert results[2]["received"] == {0: 10, 1: 10}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("silent_role", ["target", "drafter"])
def test_timeout_names_the_silent_peer(kind, silent_role):
    timeout_s = 1.0
    results = run_ranks(rank_silent, 2, kind, silent_role, timeout_s, timeout_s + 1.0, timeout=30)
    text = "no data from target rank 0" if silent_role == "target" else "no credit from drafter rank 1"
    check_silent(results, silent_role, timeout_s, text)


@pytest.mark.parametrize("kind", KINDS)
def test_end_of_data_mismatches(kind):
    # Fewer batches than the drafter wants: recv() reports the early end-of-data.
    results = run_ranks(rank_end_mismatch, 2, kind, 2, 3, timeout=60, allow_failures=True)
    assert "recv 2" in results[1] and "end-of-data at seq 2" in results[1]
    # More batches than the drafter takes: expect_end() reports the extra batch; the target then
    # fails naming the drafter instead of waiting forever.
    results = run_ranks(rank_end_mismatch, 2, kind, 3, 2, timeout=60, allow_failures=True)
    assert "expect_end" in results[1] and "expected end-of-data" in results[1]
    assert isinstance(results[0], RankFailure) and "drafter rank 1" in results[0].error


def test_every_receiver_implements_the_one_protocol():
    """A drafter run calls recv/expect_end/seek/verify/stats/close on whatever feeds it, never
    probing for a method: each receiver kind implements all of them."""
    from dflash_mp.transport.base import BaseReceiver, Receiver
    from dflash_mp.transport.files import FilesReceiver

    for cls in (Receiver, FilesReceiver):
        assert issubclass(cls, BaseReceiver) and not cls.__abstractmethods__, (cls, cls.__abstractmethods__)
    with Receiver({}) as rx:  # streamed pairs: targets re-position themselves, seek moves nothing
        rx.seek(5)
        rx.verify()
        assert rx.stats() == {"wait_ms": 0.0, "bytes_received": 0}
