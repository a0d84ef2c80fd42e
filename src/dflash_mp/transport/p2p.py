"""Point-to-point transport: `batch_isend_irecv` on a group of the pair's own, any two ranks, any nodes.

One code path for NCCL (CUDA tensors) and gloo (CPU tensors). Per (target, drafter) pair:

* A batch is one message: the target packs it into one of its `depth` staging slots (so the caller
  may reuse its tensors at once, e.g. CUDA-graph outputs) and sends the slot's bytes.
* The drafter owns `depth` slots and keeps a receive posted in every free slot. Taking batch i
  gives back the slot of batch i-1: one `batch_isend_irecv` sends the ack (credit) for i-1 and
  posts the receive of batch i-1+depth into that slot.
* The target may have `depth` batches unacknowledged. Before sending batch j >= depth it receives
  the ack of batch j-depth and waits for it on the host (that wait is `stall_ms`).

Why the drafter pairs "ack i" with "recv i+depth" in ONE batch: NCCL runs a rank's operations on
one stream in issue order, and a send only finishes when the peer's matching receive runs, so both
ends of a pair must issue the two directions in the same interleaving:

    target : s0 .. s(D-1), a0, sD, a1, s(D+1), a2, ...     (a_i = receive the ack of batch i)
    drafter: r0 .. r(D-1), [A0 + rD], [A1 + r(D+1)], ...    (A_i = send the ack; [..] one batch)

Had the drafter issued r(D+i) before A_i as separate operations, its stream would wait for batch
D+i while the target waits for ack i before sending it: a deadlock. Inside one batch the two run
concurrently. All operations, even single ones, go through `batch_isend_irecv` because NCCL picks
the communicator by call style (batched ops use the group's communicator, lone isend/irecv a private
2-rank one) and both ends must use the same one. Each pair has a group of its own
(`Topology.pair_groups`), hence an NCCL communicator and stream of its own: one pair's transfers never
queue behind another pair's or behind a collective. gloo has no streams and matches by (peer, tag):
data and acks use separate tags there; NCCL ignores tags.

End of data: the target sends an end-of-data message, then `depth-1` fillers (also flagged), so
that every receive the drafter has posted is matched and neither side has a pending operation
afterwards (a dangling NCCL receive would block the stream, and so the next collective, forever).

Host syncs: on CUDA, waiting polls `work.is_completed()` (an event query, not a sync) so timeouts
and the stall/wait metrics are measured on the host; headers are checked on the device into a
mismatch flag that `verify()` reads (one sync, at the trainer's logging interval). On CPU every
header is checked at once.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_mp.batch import FLAG_END_OF_DATA, HiddenBatch
from dflash_mp.transport.base import (
    RecvChannel,
    watching,
    SendChannel,
    Slot,
    SlotSpec,
    backoff_sleep,
    check_batch,
    new_slots,
    no_credit_msg,
    no_data_msg,
    pack_meta,
    rank_names,
)

TAG_DATA, TAG_ACK = 11, 13


def _post(ops: list[dist.P2POp]) -> list:
    return dist.batch_isend_irecv(ops)


def _op(fn, tensor: torch.Tensor, peer: int, group, tag: int) -> dist.P2POp:
    return dist.P2POp(fn, tensor, peer, group=group, tag=tag)  # peer: global rank, also with a group


def wait_works(works: list, device: torch.device, timeout_s: float, on_timeout: str, on_error: str,
               watched: bool = False) -> float:
    """Wait for `works`; raise RuntimeError naming the peer on timeout or failure. Seconds waited.

    `watched`: a liveness watcher bounds this wait (it pauses the clock while any rank is busy
    compiling or loading); the transport's own deadline then only guards against a lost watcher."""
    t0 = time.monotonic()
    deadline = t0 + (max(timeout_s, 1.0) * 1e4 if watched else timeout_s)
    try:
        if device.type == "cuda":
            for w in works:
                attempt = 0
                while not w.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    backoff_sleep(attempt)
                    attempt += 1
                w.wait()  # only orders the current stream after the NCCL stream: no host sync
        else:
            for w in works:
                left = deadline - time.monotonic()
                w.wait(timeout=timedelta(seconds=max(left, 1e-3)))
    except TimeoutError:
        raise RuntimeError(on_timeout) from None
    except Exception as e:  # noqa: BLE001 - gloo reports both timeouts and dead peers as RuntimeError
        if time.monotonic() >= deadline - 0.05:  # gloo rounds the timeout down to milliseconds
            raise RuntimeError(on_timeout) from e
        raise RuntimeError(f"{on_error}: {e}") from e
    return time.monotonic() - t0


class P2PSendChannel(SendChannel):
    def __init__(self, rank: int, peer: int, spec: SlotSpec, depth: int, timeout_s: float, group=None,
                 live=None, names: dict | None = None):
        self.rank, self.peer, self.spec, self.depth, self.timeout_s = rank, peer, spec, depth, timeout_s
        self.me_name, self.peer_name = rank_names(names, rank, peer)
        self.group, self.live = group, live
        dev = spec.device
        # One staging slot per credit: message j reuses slot j % depth only after ack j-depth.
        self._stage = new_slots(spec, depth)
        # One ack buffer is enough: each ack is received, waited for and checked before the next one.
        self._ack = torch.zeros(1, dtype=torch.int64, device=dev)
        self._bad = torch.zeros((), dtype=torch.bool, device=dev) if dev.type == "cuda" else None
        self._pending: dict[int, list] = {}  # seq -> works of its send
        self._next = 0  # seq of the next message
        self._acked = 0  # credits returned so far
        self._end_seq: int | None = None

    def _wait(self, works: list, seq: int, waiting_for: str) -> float:
        msg = no_credit_msg(self.me_name, self.peer_name, self.timeout_s, seq, self.depth)
        with watching(self.live, self.peer, f"{waiting_for} of batch {seq}", msg):
            return wait_works(
                works, self.spec.device, self.timeout_s, msg,
                f"{self.me_name}: p2p with {self.peer_name} failed ({waiting_for}, seq {seq})",
                watched=self.live is not None,
            )

    def _take_credit(self, seq: int) -> None:
        """Before message `seq`: receive the ack of seq-depth (see the module docstring for why here)."""
        if seq < self.depth:
            return
        k = seq - self.depth
        t0 = time.monotonic()
        self._wait(_post([_op(dist.irecv, self._ack, self.peer, self.group, TAG_ACK)]), seq, "credit")
        if self._bad is None:
            if int(self._ack) != k:
                got = int(self._ack)
                who = f"{self.me_name}: {self.peer_name}"
                raise RuntimeError(f"{who} acked batch {got}, expected {k}")
        else:
            self._bad |= self._ack[0] != k
        # The drafter acked k, so it holds k: the send finished and its staging slot may be reused.
        self._wait(self._pending.pop(k), k, "send")
        self._acked = k + 1
        self.stall_s += time.monotonic() - t0

    def _isend(self, batch: HiddenBatch | None, flags: int) -> None:
        seq = self._next
        self._take_credit(seq)
        slot = self._stage[seq % self.depth]
        pack_meta(slot.meta, batch, seq, flags)
        if batch is not None:  # the hidden part of end/filler messages is never read
            slot.hidden.copy_(batch.hidden)
        self._pending[seq] = _post([_op(dist.isend, slot.raw, self.peer, self.group, TAG_DATA)])
        self._next = seq + 1

    def send(self, batch: HiddenBatch) -> None:
        if self._end_seq is not None:
            raise RuntimeError(f"{self.me_name}: send() to {self.peer_name} after finish()")
        check_batch(self.spec, batch)
        self._isend(batch, flags=0)
        self.bytes_sent += self.spec.message_bytes

    def _end_message(self) -> None:
        self._isend(None, flags=FLAG_END_OF_DATA)

    def send_end(self) -> None:
        self._end_seq = self._next
        self._end_message()

    def drain(self) -> None:
        for _ in range(self.depth - 1):  # fillers: match every receive the drafter still has posted
            self._end_message()
        for seq in sorted(self._pending):
            self._wait(self._pending.pop(seq), seq, "end-of-data")
        self._acked = self._next

    def in_flight(self) -> int:
        return self._next - self._acked

    def verify(self) -> None:
        if self._bad is not None and bool(self._bad):
            raise RuntimeError(f"{self.me_name}: {self.peer_name} sent credits out of order")

    def close(self) -> None:
        # Operations still in flight after an error cannot be cancelled; dropping our references is
        # all that is left (NCCL keeps what it needs until the process group is destroyed).
        self._pending.clear()
        self._stage = []


class P2PRecvChannel(RecvChannel):
    def __init__(self, rank: int, peer: int, spec: SlotSpec, depth: int, timeout_s: float, group=None,
                 live=None, names: dict | None = None):
        self.rank, self.peer, self.spec, self.depth, self.timeout_s = rank, peer, spec, depth, timeout_s
        self.peer_name, self.me_name = rank_names(names, peer, rank)
        self.group, self.live = group, live
        dev = spec.device
        self._slots = new_slots(spec, depth)
        # Ack i is filled when batch i+1 is taken; its buffer is reused for ack i+depth, by which time
        # the batch that carried ack i (message i+depth) has been waited for.
        self._acks = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(depth)]
        self._bad = torch.zeros((), dtype=torch.bool, device=dev) if dev.type == "cuda" else None
        self._works: dict[int, list] = {}  # seq -> works to finish before slot seq % depth is valid
        self._next = 0
        self._ended = False
        for seq in range(depth):  # one batch per message: each completes on its own
            self._works[seq] = _post(self._recv_ops(seq))

    def _recv_ops(self, seq: int) -> list[dist.P2POp]:
        return [_op(dist.irecv, self._slots[seq % self.depth].raw, self.peer, self.group, TAG_DATA)]

    def _take(self, seq: int) -> Slot:
        """Return the credit of seq-1 (reposting its slot), then wait until message seq has landed."""
        if seq >= 1:
            prev = seq - 1
            ack = self._acks[prev % self.depth]
            ack.fill_(prev)
            ops = [_op(dist.isend, ack, self.peer, self.group, TAG_ACK)] + self._recv_ops(prev + self.depth)
            self._works[prev + self.depth] = _post(ops)
        self.wait_s += self._wait(seq)
        return self._slots[seq % self.depth]

    def _wait(self, seq: int) -> float:
        msg = no_data_msg(self.me_name, self.peer_name, self.timeout_s, seq)
        with watching(self.live, self.peer, f"batch {seq}", msg):
            return wait_works(
                self._works.pop(seq), self.spec.device, self.timeout_s, msg,
                f"{self.me_name}: p2p with {self.peer_name} failed (batch seq {seq})",
                watched=self.live is not None,
            )

    def _header(self, seq: int, slot: Slot) -> torch.Tensor:
        return slot.header  # on a GPU a sync: recv() checks on the device instead, expect_end() once

    def _after_end(self, seq: int) -> None:
        for filler in sorted(self._works):  # the target's fillers complete the receives still posted
            self.wait_s += self._wait(filler)

    def close(self) -> None:
        self._works.clear()
        self._slots, self._acks = [], []
