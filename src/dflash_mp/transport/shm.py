"""Same-node transport: per (target, drafter) pair, a ring of `depth` slots plus a control block in
POSIX shared memory.

Ring protocol (one producer = the target, one consumer = the drafter). The control block holds two
counters, each written by one side only, so no lock is needed: HEAD = messages published (producer),
TAIL = messages released (consumer). The producer writes message j into slot j % depth once
j - TAIL < depth, then stores HEAD = j+1; the consumer reads message k once HEAD > k, and taking
message k+1 stores TAIL = k+1 (the credit of k goes back). Publication relies on stores becoming
visible in program order, which x86-64 guarantees (the slot copies are torch kernels whose thread
join is a full barrier); an aarch64 host would need an explicit fence before the HEAD store.

Where the slots live, per pair ("mode"):
  cpu    slots in the segment; the drafter gets zero-copy views of its slot.
  ipc    slots on the target's GPU, allocated once and exported through CUDA IPC
         (`reduce_tensor`, the rebuild recipe travels over the control group); the producer records
         an interprocess event after writing a slot, the consumer's stream waits for it and copies the
         slot into its own device slot, then records its own interprocess event that the producer's
         stream waits on before overwriting. No host sync on the hot path.
  pinned slots in the segment, `cudaHostRegister`ed in both processes (GPUs without peer access).
         The producer publishes a message once its device-to-host copy has finished (checked at its
         next send, so its host stays one batch ahead); the consumer releases a slot once its
         host-to-device copy has finished (checked at the next recv).

Lifecycle. Names are `dflash_<creator pid>_<target>to<drafter>_<random>`. Setup is collective on the
control group: (1) every rank shares pid, host and device; (2) producers create segments and share
names (and IPC handles); (3) consumers attach; then, after a barrier, creators unlink every name.
From then on the memory lives exactly as long as some process maps it, so no exit path, SIGKILL
included, can leave a /dev/shm entry behind. Before the unlink the creator removes its names on
error, at exit and on SIGTERM; a creator SIGKILLed inside that window leaves a name whose pid is
dead, which `sweep_stale_segments()` removes.

Liveness. The control block holds each side's state (open / closed / failed) and heartbeat; a waiting
side checks the peer's state and pid every 50 ms, so a peer that dies or stops early is an error
naming it, and so is silence longer than `timeout_s`.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import socket
import sys
import threading
import time
from multiprocessing import resource_tracker
from multiprocessing import util as mp_util
from multiprocessing.shared_memory import SharedMemory

import _posixshmem  # what SharedMemory.unlink calls; used directly to unlink without an open handle
import torch
import torch.distributed as dist

from dflash_mp.batch import FLAG_END_OF_DATA, HiddenBatch
from dflash_mp.fsutil import pid_alive
from dflash_mp.transport.base import (
    RecvChannel,
    SendChannel,
    Slot,
    SlotSpec,
    backoff_sleep,
    watching,
    carve_slots,
    check_batch,
    new_slots,
    no_credit_msg,
    no_data_msg,
    pack_meta,
    rank_names,
)

PREFIX = "dflash_"
PAGE = 4096
CTRL_MAGIC = 0x53484D52494E47  # "SHMRING"
# Control block words (int64). HEAD and TAIL sit on their own cache lines: one writer each.
W_MAGIC, W_DEPTH, W_PRODUCER_STATE, W_CONSUMER_STATE, W_PRODUCER_BEAT, W_CONSUMER_BEAT = range(6)
W_HEAD, W_TAIL, CTRL_WORDS = 8, 16, 24
OPEN, CLOSED, FAILED = 1, 2, 3
LIVENESS_PERIOD_S = 0.05


# ---------------------------------------------------------------- segments and their cleanup
_created: set[str] = set()  # names this process created and has not unlinked yet
_prev_sigterm = None
_hooks_pid = 0  # pid that registered the exit hooks


def _open(name: str, create: bool, size: int = 0) -> SharedMemory:
    if sys.version_info >= (3, 13):
        return SharedMemory(name, create=create, size=size, track=False)
    shm = SharedMemory(name, create=create, size=size)
    # Before 3.13 every open (attaching too) registers with multiprocessing's resource tracker, which
    # would unlink or warn at exit; this module owns the lifecycle instead.
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def _on_sigterm(signum, frame) -> None:
    _unlink_created()
    prev = _prev_sigterm
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:  # default action: die of this very signal, as if never caught
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _unlink_created() -> None:
    for name in list(_created):
        unlink_segment(name)


def create_segment(name: str, size: int) -> SharedMemory:
    """Create a segment; until `unlink_segment(name)` its name is removed at exit and on SIGTERM."""
    global _prev_sigterm, _hooks_pid
    if _hooks_pid != os.getpid():  # once per process (a forked child inherits the flag, not the hooks)
        atexit.register(_unlink_created)
        # multiprocessing children leave through os._exit, skipping atexit but not these finalizers
        mp_util.Finalize(None, _unlink_created, exitpriority=100)
        _hooks_pid = os.getpid()
    if not _created and threading.current_thread() is threading.main_thread():
        _prev_sigterm = signal.getsignal(signal.SIGTERM)  # armed only while a name exists
        signal.signal(signal.SIGTERM, _on_sigterm)
    shm = _open(name, True, size)
    _created.add(name)
    return shm


def unlink_segment(name: str) -> None:
    _created.discard(name)
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
    if not _created and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _prev_sigterm if _prev_sigterm is not None else signal.SIG_DFL)


def _creator_pid(name: str, prefix: str, cuda_ipc: bool) -> int | None:
    if name.startswith(prefix):
        pid = name[len(prefix):].split("_", 1)[0]
        return int(pid) if pid.isdigit() else None
    parts = name.split(".")  # the CUDA driver's IPC-event files: cuda.shm.<n>.<pid in hex>.<n>
    if cuda_ipc and len(parts) == 5 and parts[:2] == ["cuda", "shm"]:
        try:
            return int(parts[3], 16)
        except ValueError:
            return None
    return None


def sweep_stale_segments(prefix: str = PREFIX, cuda_ipc: bool = False) -> list[str]:
    """Unlink /dev/shm/<prefix><pid>_* whose creator pid is gone; returns the names removed.

    `cuda_ipc` also removes the ~80 KiB `cuda.shm.*` files the CUDA driver leaves behind, even on a
    clean exit, for every process that exported an interprocess event (the ipc mode does).
    For launchers and tests. Assumes one pid namespace: do not run it where other containers
    share /dev/shm but not pids.
    """
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        pid = _creator_pid(name, prefix, cuda_ipc)
        if pid is not None and not pid_alive(pid):
            unlink_segment(name)
            removed.append(name)
    return removed


# ---------------------------------------------------------------- one pair's control block
class _Ring:
    """The control block as seen from one side, with a wait that watches the peer."""

    def __init__(self, shm: SharedMemory, producer: bool, me: str, peer: str, peer_pid: int, timeout_s):
        self.shm, self.me, self.peer, self.peer_pid, self.timeout_s = shm, me, peer, peer_pid, timeout_s
        self.w = shm.buf[: CTRL_WORDS * 8].cast("q")
        if self.w[W_MAGIC] != CTRL_MAGIC:
            raise RuntimeError(f"{me}: shared-memory segment {shm.name} from {peer} is not a dflash ring")
        mine = (W_PRODUCER_STATE, W_PRODUCER_BEAT) if producer else (W_CONSUMER_STATE, W_CONSUMER_BEAT)
        theirs = (W_CONSUMER_STATE, W_CONSUMER_BEAT) if producer else (W_PRODUCER_STATE, W_PRODUCER_BEAT)
        (self._state, self._beat), (self._peer_state, self._peer_beat) = mine, theirs
        self.live, self.peer_rank = None, None  # set by build_transport where a watcher bounds waits
        self.set_state(OPEN)

    def beat(self) -> None:
        self.w[self._beat] = time.monotonic_ns()

    def set_state(self, state: int) -> None:
        self.w[self._state] = state
        self.beat()

    def check_peer(self) -> None:
        state = self.w[self._peer_state]
        if state in (CLOSED, FAILED):
            how = "closed its channel" if state == CLOSED else "stopped early (error or exit), channel closed"
            raise RuntimeError(f"{self.me}: {self.peer} {how}")
        if not pid_alive(self.peer_pid):
            age = (time.monotonic_ns() - self.w[self._peer_beat]) / 1e9
            pid = self.peer_pid
            raise RuntimeError(f"{self.me}: {self.peer} (pid {pid}) died; last heard of {age:.1f} s ago")

    def wait(self, ready, timeout_msg: str, what: str = "data") -> float:
        """Block until ready(); seconds waited. Raises if the peer dies, closes, or stays silent
        (for `timeout_s`, or as the liveness watcher decides where there is one)."""
        if ready():
            return 0.0
        with watching(self.live, self.peer_rank, what, timeout_msg):
            return self._wait(ready, timeout_msg)

    def _wait(self, ready, timeout_msg: str) -> float:
        t0 = time.monotonic()
        next_check, attempt = t0, 0
        while not ready():
            now = time.monotonic()
            if now >= next_check:
                try:
                    self.check_peer()
                except RuntimeError:
                    if ready():  # it did its part just before it closed or exited
                        break
                    raise
                if self.live is None and now - t0 >= self.timeout_s:
                    raise RuntimeError(timeout_msg)
                next_check = now + LIVENESS_PERIOD_S
            backoff_sleep(attempt)
            attempt += 1
        self.beat()
        return time.monotonic() - t0

    def close(self, state: int) -> None:
        self.set_state(state)
        self.w.release()
        try:
            self.shm.close()
        except BufferError:
            pass  # the caller still holds slot views; the mapping goes at exit, the name is long gone


# ---------------------------------------------------------------- slot storage
def _data(shm: SharedMemory, spec: SlotSpec, depth: int) -> torch.Tensor:
    return torch.frombuffer(shm.buf, dtype=torch.uint8, offset=PAGE, count=depth * spec.slot_bytes)


def _host_register(t: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 1)  # 1: cudaHostRegisterPortable
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the shm ring failed ({err}): try shm_cuda=ipc or kind=p2p")


def _host_unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _ipc_events(n: int) -> tuple[list, list]:
    """Interprocess events on the current device, and their handles (asking for a handle is what
    creates the event, on the current device: keep both inside the caller's device guard)."""
    events = [torch.cuda.Event(enable_timing=False, interprocess=True) for _ in range(n)]
    return events, [e.ipc_handle() for e in events]


# ---------------------------------------------------------------- channels
class ShmSendChannel(SendChannel):
    def __init__(self, rank, peer, spec: SlotSpec, depth, timeout_s, ring: _Ring, mode: str, slots, *,
                 host_data=None, written=None, copied=None):
        self.rank, self.peer, self.spec, self.depth, self.timeout_s = rank, peer, spec, depth, timeout_s
        self.me_name, self.peer_name = ring.me, ring.peer
        self.ring, self.mode, self._slots = ring, mode, slots
        self._host_data = host_data  # pinned: the registered region, unregistered on close
        self._written, self._copied = written, copied  # ipc: interprocess events per slot
        self._next = 0
        self._pending: list[int] = []  # pinned: written, published once the copy to host is done
        self._drained = self._closed = False
        if mode == "pinned":
            dev = spec.device
            self._stage = [torch.empty(spec.meta_len, dtype=torch.int64, device=dev) for _ in range(depth)]
            self._copy_done = [torch.cuda.Event() for _ in range(depth)]

    def _publish_ready(self) -> None:
        for seq in self._pending:
            self._copy_done[seq % self.depth].synchronize()
            self.ring.w[W_HEAD] = seq + 1
        self._pending.clear()

    def _write(self, batch: HiddenBatch | None, flags: int) -> None:
        seq, i, w = self._next, self._next % self.depth, self.ring.w
        self._publish_ready()  # before blocking on credit: the drafter may be waiting for these
        msg = no_credit_msg(self.me_name, self.peer_name, self.timeout_s, seq, self.depth)
        self.stall_s += self.ring.wait(lambda: seq - w[W_TAIL] < self.depth, msg, f"credit for batch {seq}")
        slot = self._slots[i]
        if self.mode == "pinned":
            pack_meta(self._stage[i], batch, seq, flags)
            slot.meta.copy_(self._stage[i], non_blocking=True)
            if batch is not None:
                slot.hidden.copy_(batch.hidden, non_blocking=True)
            self._copy_done[i].record()
            self._pending.append(seq)
        else:
            if self.mode == "ipc" and seq >= self.depth:
                torch.cuda.current_stream().wait_event(self._copied[i])  # the drafter copied it out
            pack_meta(slot.meta, batch, seq, flags)
            if batch is not None:
                slot.hidden.copy_(batch.hidden)
            if self.mode == "ipc":
                self._written[i].record(torch.cuda.current_stream(self.spec.device))
            w[W_HEAD] = seq + 1
        self._next = seq + 1
        self.ring.beat()

    def send(self, batch: HiddenBatch) -> None:
        check_batch(self.spec, batch)
        self._write(batch, 0)
        self.bytes_sent += self.spec.message_bytes

    def send_end(self) -> None:
        self._write(None, FLAG_END_OF_DATA)

    def drain(self) -> None:
        self._publish_ready()
        end = self._next
        who = f"{self.me_name}: {self.peer_name}"
        msg = f"{who} did not take end-of-data in {self.timeout_s:.0f} s"
        self.ring.wait(lambda: self.ring.w[W_TAIL] >= end, msg, "end-of-data to be taken")
        self._drained = True

    def in_flight(self) -> int:
        return 0 if self._closed else self._next - self.ring.w[W_TAIL]

    def verify(self) -> None:
        pass  # credits are host counters here, checked as they are read

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.mode == "pinned":
            for ev in self._copy_done:  # no DMA may target the region once it is unregistered
                ev.synchronize()
            _host_unregister(self._host_data)
        self._slots = self._host_data = self._written = self._copied = None
        self.ring.close(CLOSED if self._drained else FAILED)


class ShmRecvChannel(RecvChannel):
    def __init__(self, rank, peer, spec: SlotSpec, depth, timeout_s, ring: _Ring, mode: str, remote, *,
                 host_data=None, written=None, copied=None, remote_device=None):
        self.rank, self.peer, self.spec, self.depth, self.timeout_s = rank, peer, spec, depth, timeout_s
        self.me_name, self.peer_name = ring.me, ring.peer
        self.ring, self.mode, self._remote = ring, mode, remote  # remote: the producer-written slots
        self._host_data, self._written, self._copied = host_data, written, copied
        self._remote_device = remote_device
        self._next = 0
        self._ended = self._closed = False
        # ipc: the header arrives in device memory, so recv() checks it there (no sync)
        self._bad = torch.zeros((), dtype=torch.bool, device=spec.device) if mode == "ipc" else None
        if mode == "cpu":
            self._local = remote  # zero copy: the drafter reads the shared slot itself
        else:
            self._local = new_slots(spec, depth)
        if mode == "pinned":
            self._copied = [torch.cuda.Event() for _ in range(depth)]

    def _release(self, upto: int) -> None:
        """Give back every slot before message `upto`."""
        if self.mode == "pinned":  # the producer overwrites host memory: our copy must be done
            self._copied[(upto - 1) % self.depth].synchronize()
        self.ring.w[W_TAIL] = upto
        self.ring.beat()

    def _take(self, seq: int) -> Slot:
        if seq >= 1:
            self._release(seq)
        msg = no_data_msg(self.me_name, self.peer_name, self.timeout_s, seq)
        self.wait_s += self.ring.wait(lambda: self.ring.w[W_HEAD] > seq, msg, f"batch {seq}")
        i = seq % self.depth
        src, dst = self._remote[i], self._local[i]
        if self.mode == "ipc":
            # The copy runs on the producer-device stream (torch's rule for cross-device copies, which
            # also makes our own stream wait for it); its interprocess events live on that device.
            with torch.cuda.device(self._remote_device):
                stream = torch.cuda.current_stream()
                stream.wait_event(self._written[i])
                dst.raw.copy_(src.raw)
                self._copied[i].record(stream)
        elif self.mode == "pinned":
            dst.raw.copy_(src.raw, non_blocking=True)
            self._copied[i].record()
        return dst

    def _header(self, seq: int, slot: Slot) -> torch.Tensor:
        # cpu / pinned: the producer's host copy, complete once published (no GPU sync); ipc: the
        # device copy, a sync, read only by expect_end().
        return slot.header if self.mode == "ipc" else self._remote[seq % self.depth].header

    def _after_end(self, seq: int) -> None:
        self._release(seq + 1)  # the producer's drain() waits for this

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.mode != "cpu":  # copies still reading the producer's memory must end first
            for ev in self._copied:
                ev.synchronize()
        if self.mode == "pinned":
            _host_unregister(self._host_data)
        self._remote = self._local = self._host_data = self._written = self._copied = None
        self.ring.close(CLOSED if self._ended else FAILED)


# ---------------------------------------------------------------- setup (collective)
def _gather(group, obj) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _step(group, fn) -> list:
    """Run fn() here and share its result; if it failed on any rank, raise on every rank, so no
    rank is left waiting in the next collective."""
    try:
        payload, err = fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others have heard of it
        payload, err = None, e
    out = _gather(group, (payload, None if err is None else f"{type(err).__name__}: {err}"))
    if err is not None:
        raise err
    failed = [f"rank {r}: {e}" for r, (_, e) in enumerate(out) if e]
    if failed:
        raise RuntimeError("shm transport setup failed on " + "; ".join(failed))
    return [p for p, _ in out]


def _full_device(dev: torch.device) -> torch.device:
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def pair_mode(producer_dev: torch.device, consumer_dev: torch.device, shm_cuda: str = "auto") -> str:
    """cpu | ipc | pinned for one pair; both ends compute it from the same inputs."""
    if producer_dev.type != consumer_dev.type or producer_dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"shm transport between a {producer_dev} target and a {consumer_dev} drafter is not supported: "
            "put both roles on CUDA (or both on CPU), or use transport.kind=p2p"
        )
    if producer_dev.type == "cpu":
        return "cpu"
    if shm_cuda in ("ipc", "pinned"):
        return shm_cuda
    if shm_cuda != "auto":
        raise ValueError(f"transport.shm_cuda={shm_cuda!r}: choose auto, ipc or pinned")
    peer_ok = producer_dev.index == consumer_dev.index or torch.cuda.can_device_access_peer(
        consumer_dev.index, producer_dev.index
    )
    return "ipc" if peer_ok else "pinned"


def open_shm_channels(topology, spec: SlotSpec, depth: int, timeout_s: float, pairs, shm_cuda="auto",
                      names: dict | None = None) -> dict:
    """Build this rank's shm channels, keyed by peer rank. Collective over `topology.control_group`:
    every rank calls it, with the same `pairs` (every shm (producer, consumer) pair of one message
    shape: the target->drafter pairs, or one stage boundary). `names`: rank -> how messages name it."""
    from torch.multiprocessing.reductions import reduce_tensor

    me, group, dev = topology.rank, topology.control_group, _full_device(spec.device)
    # The control group spans the whole world in rank order, so gathered lists index by global rank.
    infos = _gather(group, {"pid": os.getpid(), "host": socket.gethostname(), "device": str(dev)})
    plan: dict[tuple[int, int], dict] = {}
    created: list[str] = []

    def prepare() -> dict:
        exports = {}
        for t, d in (p for p in pairs if me in p):
            producer, peer = me == t, (d if me == t else t)
            if infos[peer]["host"] != infos[me]["host"]:
                raise ValueError(
                    f"ranks {t} and {d} are on hosts {infos[t]['host']} / {infos[d]['host']}, but the "
                    "topology placed them on one node: fix ranks_per_node, or use transport.kind=p2p"
                )
            pdev = dev if producer else torch.device(infos[t]["device"])
            cdev = torch.device(infos[d]["device"]) if producer else dev
            mode = pair_mode(pdev, cdev, shm_cuda)
            st = plan[(t, d)] = {"peer": peer, "producer": producer, "pdev": pdev, "mode": mode}
            ipc = st["mode"] == "ipc"
            if producer:
                data_bytes = depth * spec.slot_bytes
                st["name"] = f"{PREFIX}{os.getpid()}_{t}to{d}_{secrets.token_hex(4)}"
                st["shm"] = create_segment(st["name"], PAGE + (0 if ipc else data_bytes))
                created.append(st["name"])
                w = st["shm"].buf[: CTRL_WORDS * 8].cast("q")
                w[W_MAGIC], w[W_DEPTH] = CTRL_MAGIC, depth
                w.release()
                exports[(t, d)] = {"name": st["name"]}
                if ipc:  # the producer keeps these alive for the whole run
                    with torch.cuda.device(dev):
                        st["buf"] = torch.empty(data_bytes, dtype=torch.uint8, device=dev)
                        st["written"], handles = _ipc_events(depth)
                    exports[(t, d)].update(buf=reduce_tensor(st["buf"]), written=handles)
            elif ipc:
                with torch.cuda.device(pdev):  # recorded on the producer-device stream, see ShmRecvChannel
                    st["copied"], handles = _ipc_events(depth)
                exports[(t, d)] = {"copied": handles}
        return exports

    def attach(exports: list) -> bool:
        for (t, d), st in plan.items():
            theirs = exports[st["peer"]][(t, d)] if (t, d) in exports[st["peer"]] else {}
            if not st["producer"]:
                st["name"] = theirs["name"]
                st["shm"] = _open(st["name"], False)
            if st["mode"] == "ipc":
                if st["producer"]:
                    st["copied"] = [torch.cuda.Event.from_ipc_handle(dev, h) for h in theirs["copied"]]
                else:
                    rebuild, args = theirs["buf"]
                    st["buf"] = rebuild(*args)
                    handles = theirs["written"]
                    st["written"] = [torch.cuda.Event.from_ipc_handle(st["pdev"], h) for h in handles]
            else:
                st["buf"] = _data(st["shm"], spec, depth)
                if st["mode"] == "pinned":
                    _host_register(st["buf"])
                    st["registered"] = True
            ends = rank_names(names, t, d)
            me_desc, peer_desc = ends if st["producer"] else ends[::-1]
            peer_pid = infos[st["peer"]]["pid"]
            st["ring"] = _Ring(st["shm"], st["producer"], me_desc, peer_desc, peer_pid, timeout_s)
        return True

    try:
        exports = _step(group, prepare)
        _step(group, lambda: attach(exports))  # doubles as the barrier before the unlink below
    except BaseException:
        for st in plan.values():
            if st.get("registered"):
                _host_unregister(st["buf"])
            st.pop("buf", None)
            if "ring" in st:
                st["ring"].close(FAILED)
            elif "shm" in st:
                st["shm"].close()
        raise
    finally:
        for name in created:  # every consumer has it mapped now (or setup failed): the name can go
            unlink_segment(name)

    channels = {}
    for (t, d), st in plan.items():
        mode = st["mode"]
        slots = carve_slots(st["buf"], spec, depth)
        kw = {"written": st.get("written"), "copied": st.get("copied")}
        kw["host_data"] = st["buf"] if mode == "pinned" else None
        if st["producer"]:
            ch = ShmSendChannel(me, d, spec, depth, timeout_s, st["ring"], mode, slots, **kw)
        else:
            kw["remote_device"] = st["pdev"]
            ch = ShmRecvChannel(me, t, spec, depth, timeout_s, st["ring"], mode, slots, **kw)
        ch.segment_name = st["name"]
        channels[st["peer"]] = ch
    return channels
