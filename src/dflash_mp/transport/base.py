"""What every transport shares: the slot layout, per-pair channels, and the role-level facades.

A message on a (target, drafter) pair is one fixed-size slot of bytes, viewed as two tensors:

    meta   int64 [HEADER_LEN + 4*T]   header (magic, seq, num_valid_tokens, flags), then the four
                                      token fields of `TOKEN_FIELDS`, each [T]
    hidden spec.hidden_dtype [T, H]   at a 64-byte aligned offset

so a batch is exactly one message (one NCCL/gloo transfer, one ring slot). A transport is a set of
per-pair channels; `Sender` and `Receiver` route by peer rank, so one rank can mix shm pairs (same
node) and p2p pairs. `BaseReceiver` is what a drafter run calls on whatever feeds it (the streaming
`Receiver`, or `files.FilesReceiver` over a dump).
"""

from __future__ import annotations

import abc
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from dflash_mp.batch import FLAG_END_OF_DATA, TOKEN_FIELDS, HiddenBatch

MAGIC = 0x44464C5348  # "DFLSH": catches a slot that was never written or a misaligned stream
HEADER_LEN = 4
H_MAGIC, H_SEQ, H_VALID, H_FLAGS = range(HEADER_LEN)


@dataclass(frozen=True)
class SlotSpec:
    """Shape of every message on every pair; identical on all ranks except `device`."""

    seq_len: int  # T: tokens per batch
    hidden_dim: int  # K*H: width of the concatenated captured hidden states
    hidden_dtype: torch.dtype  # dtype of `hidden` (bf16 on GPU, fp32 in CPU tests)
    device: torch.device  # where this rank keeps its slots (the target's / drafter's own device)

    def __post_init__(self):
        object.__setattr__(self, "device", torch.device(self.device))  # accept "cuda:0" too

    @property
    def meta_len(self) -> int:
        return HEADER_LEN + len(TOKEN_FIELDS) * self.seq_len

    @property
    def hidden_bytes(self) -> int:
        return self.seq_len * self.hidden_dim * self.hidden_dtype.itemsize

    @property
    def message_bytes(self) -> int:
        """Payload bytes of one batch (what the stats count)."""
        return self.meta_len * 8 + self.hidden_bytes

    @property
    def hidden_offset(self) -> int:
        return _align(self.meta_len * 8)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot, padding included (what is transferred and allocated)."""
        return _align(self.hidden_offset + self.hidden_bytes)


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def check_batch(spec: SlotSpec, batch: HiddenBatch) -> None:
    """A wrong shape would make the peer receive garbage or wait forever: refuse it up front."""
    t, h = spec.seq_len, spec.hidden_dim
    if tuple(batch.hidden.shape) != (t, h) or batch.hidden.dtype != spec.hidden_dtype:
        raise ValueError(
            f"HiddenBatch.hidden is {tuple(batch.hidden.shape)} {batch.hidden.dtype}, but the transport "
            f"was built for [{t}, {h}] {spec.hidden_dtype}: build SlotSpec from the packing seq_len and "
            "the captured hidden width."
        )
    for name in TOKEN_FIELDS:
        if tuple(getattr(batch, name).shape) != (t,):
            shape = tuple(getattr(batch, name).shape)
            raise ValueError(f"HiddenBatch.{name} has shape {shape}, expected [{t}].")


def pack_meta(meta: torch.Tensor, batch: HiddenBatch | None, seq: int, flags: int) -> None:
    """Write header and token fields into `meta` with device ops only (no host sync on GPU).

    `fill_` with a Python scalar is a kernel argument, not a host-to-device copy, so this never
    waits for the GPU. `batch=None` writes an end-of-data message with zero tokens.
    """
    header = meta[:HEADER_LEN]
    header[H_MAGIC].fill_(MAGIC)
    header[H_SEQ].fill_(seq)
    header[H_VALID].fill_(batch.num_valid_tokens if batch is not None else 0)
    header[H_FLAGS].fill_(flags)
    tokens = meta[HEADER_LEN:].view(len(TOKEN_FIELDS), -1)
    if batch is None:
        tokens.zero_()
        return
    fields = [getattr(batch, f) for f in TOKEN_FIELDS]
    if all(f.device == meta.device and f.dtype == torch.int64 for f in fields):
        torch.stack(fields, out=tokens)  # one kernel
    else:
        for i, f in enumerate(fields):
            tokens[i].copy_(f, non_blocking=True)


class Slot:
    """One slot: `raw` bytes and the meta/hidden views of them. The views are built once, so every
    batch returned from this slot carries the very same tensor objects (stable addresses)."""

    def __init__(self, raw: torch.Tensor, spec: SlotSpec):
        self.raw = raw
        self.meta = raw[: spec.meta_len * 8].view(torch.int64)
        hidden = raw[spec.hidden_offset : spec.hidden_offset + spec.hidden_bytes].view(spec.hidden_dtype)
        self.hidden = hidden.view(spec.seq_len, spec.hidden_dim)
        self.header = self.meta[:HEADER_LEN]
        tokens = self.meta[HEADER_LEN:].view(len(TOKEN_FIELDS), -1)
        self.fields = {name: tokens[i] for i, name in enumerate(TOKEN_FIELDS)}

    def batch(self, seq: int, num_valid: int, flags: int) -> HiddenBatch:
        return HiddenBatch(self.hidden, seq=seq, num_valid_tokens=num_valid, flags=flags, **self.fields)


def carve_slots(buf: torch.Tensor, spec: SlotSpec, depth: int) -> list[Slot]:
    """`depth` slots out of one flat uint8 buffer (shared memory, or a device allocation)."""
    return [Slot(buf[i * spec.slot_bytes : (i + 1) * spec.slot_bytes], spec) for i in range(depth)]


def new_slots(spec: SlotSpec, depth: int) -> list[Slot]:
    buf = torch.zeros(depth * spec.slot_bytes, dtype=torch.uint8, device=spec.device)
    return carve_slots(buf, spec, depth)


def rank_names(names: dict | None, producer: int, consumer: int) -> tuple[str, str]:
    """How a channel's messages name its two ends: from `names` (Topology.name of every rank: a staged
    target's consumer is a target stage), else "target rank P" and "drafter rank C"."""
    names = names or {}
    return names.get(producer, f"target rank {producer}"), names.get(consumer, f"drafter rank {consumer}")


def no_data_msg(consumer: str, producer: str, timeout_s: float, seq: int) -> str:
    return f"no data from {producer} for {timeout_s:.0f} s ({consumer} waiting for batch {seq})"


def no_credit_msg(producer: str, consumer: str, timeout_s: float, seq: int, depth: int) -> str:
    return (
        f"no credit from {consumer} for {timeout_s:.0f} s ({producer} waiting to send batch "
        f"{seq}; its peer has not taken batch {seq - depth + 1} yet)"
    )


def header_error(peer: str, me: str, header: list[int], expect_seq: int, expect_end: bool) -> str | None:
    """Describe what is wrong with a received header, or None when it is the expected message."""
    magic, seq, _, flags = header
    if magic != MAGIC:
        return f"{me}: corrupt message from {peer} (bad magic {magic:#x}) at seq {expect_seq}"
    if seq != expect_seq:
        return f"{me}: out-of-order message from {peer}: got seq {seq}, expected {expect_seq}"
    is_end = bool(flags & FLAG_END_OF_DATA)
    if is_end and not expect_end:
        return (
            f"{me}: {peer} sent end-of-data at seq {seq} but a batch was expected: the target ran out of "
            "data before the drafter's planned number of steps (check Topology.num_sends and the data size)"
        )
    if expect_end and not is_end:
        return (
            f"{me}: expected end-of-data from {peer} at seq {seq} but got a batch: the target produced more "
            "batches than this drafter consumed"
        )
    return None


def device_header_mismatch(header: torch.Tensor, expect_seq: int) -> torch.Tensor:
    """0/1 on device: the header is not data message `expect_seq` (no host sync)."""
    bad = (header[H_MAGIC] != MAGIC) | (header[H_SEQ] != expect_seq)
    return bad | ((header[H_FLAGS] & FLAG_END_OF_DATA) != 0)


def watching(live, peer: int, what: str, timeout_msg: str = ""):
    """Tell the liveness watcher (if any) that this rank now waits on `peer` for `what`."""
    return nullcontext() if live is None else live.waiting(peer, what, timeout_msg)


def backoff_sleep(attempt: int) -> None:
    """Poll politely: yield first (latency), then sleep up to 1 ms (do not burn a core on waits)."""
    if attempt < 50:
        time.sleep(0)
    else:
        time.sleep(min(1e-3, 2e-5 * (attempt - 49)))


class SendChannel:
    """One (this target, one drafter) pair, sending side."""

    peer: int
    stall_s: float = 0.0  # host time blocked waiting for credit, accumulated
    bytes_sent: int = 0
    me_name: str = ""  # "target rank 0"; rank_names()
    peer_name: str = ""  # "drafter rank 2", or the next stage of a staged target

    def send(self, batch: HiddenBatch) -> None: ...
    def send_end(self) -> None: ...  # the end-of-data message, in order after the last batch
    def drain(self) -> None: ...  # after send_end: wait until the peer holds everything
    def in_flight(self) -> int: ...  # messages whose credit has not been observed yet
    def verify(self) -> None: ...
    def close(self) -> None: ...


class RecvChannel:
    """One (one target, this drafter) pair, receiving side.

    Transports set `rank`, `peer`, `spec`, `_next` (seq of the next message), `_ended`, `_bad` (a
    device flag when headers are checked on the GPU without a sync, else None) and provide
    `_take(seq)` (wait until message `seq` is in a slot; return the slot), `_header(seq, slot)`
    (the header to read on the host: a host copy where there is one) and `_after_end(seq)` (what
    the transport does once the end-of-data message `seq` has been checked).
    """

    peer: int
    wait_s: float = 0.0  # host time blocked waiting for data, accumulated
    bytes_received: int = 0
    me_name: str = ""  # "drafter rank 2", or a target stage after the first; rank_names()
    peer_name: str = ""  # "target rank 0"

    def recv(self) -> HiddenBatch:
        if self._ended:
            raise RuntimeError(f"{self.me_name}: recv() from {self.peer_name} after its end")
        seq = self._next
        slot = self._take(seq)
        self._next = seq + 1
        self.bytes_received += self.spec.message_bytes
        if self._bad is not None:  # the header is on the GPU: checked there, raised by verify()
            self._bad |= device_header_mismatch(slot.header, seq)
            return slot.batch(seq, -1, 0)  # num_valid_tokens would need a sync: use doc_ids >= 0 on device
        _, _, valid, flags = self._check_header(seq, slot, expect_end=False)
        return slot.batch(seq, valid, flags)

    def _check_header(self, seq: int, slot: Slot, expect_end: bool) -> list[int]:
        header = self._header(seq, slot).tolist()
        err = header_error(self.peer_name, self.me_name, header, seq, expect_end)
        if err:
            raise RuntimeError(err)
        return header

    def expect_end(self) -> None:
        """The next message must be the end-of-data marker; then the pair is finished."""
        seq = self._next
        slot = self._take(seq)
        self._next = seq + 1
        self._check_header(seq, slot, expect_end=True)  # on the host, even where recv() checks on the GPU
        self._after_end(seq)
        self._ended = True
        self.verify()

    def _after_end(self, seq: int) -> None: ...

    def verify(self) -> None:
        if self._bad is not None and bool(self._bad):
            raise RuntimeError(
                f"{self.me_name}: a message from {self.peer_name} had a bad header "
                "(corrupt, out of order, or an unexpected end-of-data)"
            )

    def close(self) -> None: ...


class _Endpoint:
    def __init__(self, channels: dict, role: str):
        self._channels = channels
        self._role = role
        self._closed = False
        self._last: dict[str, float] = {}

    def _channel(self, peer: int):
        try:
            return self._channels[peer]
        except KeyError:
            raise ValueError(
                f"rank {peer} is not a peer of this {self._role} (peers: {sorted(self._channels)}); "
                "use Topology.feeds / Topology.sources to pick peers"
            ) from None

    def _delta(self, key: str, total: float) -> float:
        prev, self._last[key] = self._last.get(key, 0.0), total
        return total - prev

    def verify(self) -> None:
        """Raise if any received header was wrong (one host sync per pair on GPU: call it rarely)."""
        for ch in self._channels.values():
            ch.verify()

    def close(self) -> None:
        """Idempotent; releases every slot, segment and mapping, also after an error."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for ch in self._channels.values():
            try:
                ch.close()
            except Exception as e:  # noqa: BLE001 - close the others first, then report
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sender(_Endpoint):
    """Target side: `send(dst, batch)` per batch, `finish()` once, `close()` always."""

    upstream: "Receiver | None" = None  # a staged target's previous stage (transport.build_transport)

    def __init__(self, channels: dict[int, SendChannel]):
        super().__init__(channels, "target")

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.upstream is not None:
                self.upstream.close()

    def send(self, dst: int, batch: HiddenBatch) -> None:
        """Asynchronous; blocks only while `dst` has no free credit (counted in `stall_ms`)."""
        self._channel(dst).send(batch)

    def finish(self) -> None:
        # End-of-data goes to every peer before draining any: a drafter that is waiting for its end
        # message must not wait for another drafter to drain first.
        for ch in self._channels.values():
            ch.send_end()
        for ch in self._channels.values():
            ch.drain()

    def stats(self) -> dict:
        """stall_ms / bytes_sent: since the previous call; in_flight: now, summed over peers."""
        chs = self._channels.values()
        return {
            "stall_ms": 1e3 * self._delta("stall", sum(c.stall_s for c in chs)),
            "in_flight": sum(c.in_flight() for c in chs),
            "bytes_sent": int(self._delta("bytes", sum(c.bytes_sent for c in chs))),
        }


class BaseReceiver(abc.ABC):
    """The drafter side of every transport: a drafter run calls exactly these, whatever the kind."""

    @abc.abstractmethod
    def recv(self, src: int) -> HiddenBatch:
        """Next batch from `src`; its tensors stay valid until the next recv(src)."""

    @abc.abstractmethod
    def expect_end(self, src: int) -> None:
        """Once per source after the last step: the source has nothing more (raises if it has)."""

    @abc.abstractmethod
    def seek(self, step: int) -> None:
        """Continue at drafter step `step` (a resumed run), before the first recv."""

    @abc.abstractmethod
    def verify(self) -> None:
        """Raise if a message received so far was wrong (may sync the device: call it rarely)."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """wait_ms / bytes_received since the previous call."""

    @abc.abstractmethod
    def close(self) -> None:
        """Idempotent; releases every buffer, also after an error."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Receiver(_Endpoint, BaseReceiver):
    """Drafter side: `recv(src)` per batch, `expect_end(src)` once per source, `close()` always."""

    def __init__(self, channels: dict[int, RecvChannel]):
        super().__init__(channels, "drafter")

    def recv(self, src: int) -> HiddenBatch:
        """Next batch from `src`, in order; its tensors are slot buffers valid until the next recv(src)."""
        return self._channel(src).recv()

    def expect_end(self, src: int) -> None:
        self._channel(src).expect_end()

    def seek(self, step: int) -> None:
        """Nothing to move here: each target re-positions its own data at the resumed step (its cursor
        is a function of the drafter step), so the next message on every pair is already the right one."""

    def stats(self) -> dict:
        """wait_ms / bytes_received: since the previous call."""
        chs = self._channels.values()
        return {
            "wait_ms": 1e3 * self._delta("wait", sum(c.wait_s for c in chs)),
            "bytes_received": int(self._delta("bytes", sum(c.bytes_received for c in chs))),
        }
