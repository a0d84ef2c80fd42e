"""Atomic, self-describing checkpoints.

Layout: `<root>/step_00000042/{manifest.json, drafter.pt, rng_rank{r}.pt}`. Everything is written
into `<root>/.tmp_step_00000042` first; the manifest goes last and the directory is renamed only
when complete, so a kill mid-write leaves the previous checkpoint the newest loadable one.
Target ranks need no state of their own: their data cursor is a function of the drafter step.
`Checkpointer` is the protocol a drafter rank runs (save, resume, RNG state); the functions below are
the file-level parts it, `rundir` and start-up validation share.
`drafter.pt` holds `{"drafter": fp32 master weights by parameter name, "optimizer": the flat AdamW
moments and step count, "step": int}` (`DrafterTrainer.state_dict`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .resilience import maybe_fault

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{8})$")


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2  # newest complete checkpoints to keep; older ones are pruned
    resume: str = ""  # "" = fresh start | auto = newest complete checkpoint under dir, if any | a step dir
    dir: str = ""  # checkpoint root; "" = <run_dir>/checkpoints
    # A fresh run refuses a run_dir holding another run's checkpoints or export; true deletes them.
    overwrite: bool = False


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def tmp_dir(root: str, step: int) -> str:
    return os.path.join(root, "." + step_name(step))


def _fsync_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_file(obj, path: str) -> None:
    """torch.save through a temp name, so a file either exists whole or not at all."""
    part = path + ".part"
    with open(part, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def commit(root: str, step: int, manifest: dict, keep: int) -> str:
    """Write the manifest into the temp dir, rename it into place, prune old ones. Leader only."""
    tmp = tmp_dir(root, step)
    files = sorted(f for f in os.listdir(tmp) if not f.endswith(".part"))
    manifest = {**manifest, "step": step, "files": files, "time": time.time()}
    _fsync_write(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=2).encode())
    final = os.path.join(root, step_name(step))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune(root, keep, manifest.get("run_id"))
    return final


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint dirs under root, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        if not _STEP_RE.match(name):
            continue
        path = os.path.join(root, name)
        try:
            read_manifest(path)
        except ValueError as e:
            log.debug("skipping incomplete checkpoint: %s", e)  # rundir.claim says it once, on rank 0
            continue
        out.append(path)
    return out


def prune(root: str, keep: int, run_id: str | None = None) -> None:
    """Keep the newest `keep` complete checkpoints of run `run_id` (None: of any run); a checkpoint
    of another run is never removed, whatever its step."""
    done = complete_checkpoints(root)
    if run_id is not None:
        done = [p for p in done if read_manifest(p).get("run_id") == run_id]
    for path in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(path, ignore_errors=True)
    newest = int(_STEP_RE.match(os.path.basename(done[-1])).group(1)) if done else -1
    for name in os.listdir(root):  # temp dirs of writes that never finished
        if name.startswith(".step_") and int(name[len(".step_"):]) <= newest:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def read_manifest(path: str) -> dict:
    """The manifest of a complete checkpoint; ValueError naming the problem otherwise."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} has no {MANIFEST} (incomplete write?): pick another "
                         "checkpoint or resume=auto to take the newest complete one.") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint {path}: corrupt {MANIFEST} ({e}): pick another checkpoint "
                         "(checkpoint.resume) or resume=auto to take the newest complete one.") from None
    missing = [f for f in manifest.get("files", []) if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise ValueError(f"checkpoint {path} is missing {missing}: pick another checkpoint.")
    return manifest


def resolve_resume(resume: str, root: str) -> str | None:
    """The checkpoint dir to resume from, or None for a fresh start."""
    if not resume:
        return None
    if resume == "auto":
        done = complete_checkpoints(root)
        return done[-1] if done else None
    if not os.path.isdir(resume):
        raise ValueError(f"checkpoint.resume={resume!r} does not exist: pass a step_* directory, "
                         "'auto', or '' for a fresh start.")
    read_manifest(resume)
    return resume


def resume_point(resume: str, root: str) -> tuple[int, str | None]:
    """(step, checkpoint dir) to continue from for `checkpoint.resume`; (0, None): fresh start."""
    path = resolve_resume(resume, root)
    if path is None:
        return 0, None
    return int(read_manifest(path)["step"]), path


def validate_resume(resume: str, root: str, drafter_ranks, world_size: int) -> str | None:
    """Resolve `checkpoint.resume` and check, cheaply and before any process group exists, that the
    checkpoint is complete, readable and written by this topology; ValueError naming the fix."""
    path = resolve_resume(resume, root)
    if path is None:
        return None
    manifest = read_manifest(path)
    if manifest.get("world_size", world_size) != world_size:
        raise ValueError(f"checkpoint {path} was written by a {manifest['world_size']}-rank job; this one has "
                         f"{world_size}: resume with the same topology (rng state is per rank).")
    for name in ["drafter.pt"] + [rng_file(r) for r in drafter_ranks]:
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise ValueError(f"checkpoint {path} has no {name}: pick another checkpoint or resume=auto.")
        try:  # torch.save writes a zip: its central directory (at the end) catches torn or foreign files
            with zipfile.ZipFile(file) as z:
                z.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            raise ValueError(f"checkpoint file {file} is corrupt ({e}): pick another checkpoint "
                             "or resume=auto to take the newest complete one.") from None
    return path


def load_file(path: str, name: str, map_location="cpu"):
    try:
        return torch.load(os.path.join(path, name), map_location=map_location, weights_only=False)
    except Exception as e:  # a torn or foreign file: name it, never crash deep inside torch
        raise ValueError(f"checkpoint file {os.path.join(path, name)} cannot be loaded ({e}): pick another "
                         "checkpoint (checkpoint.resume) or start fresh (checkpoint.resume='').") from None


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def get_rng_state() -> dict:
    """This process's RNG states: the CPU's, and the current GPU's where the process uses CUDA (asked on a
    machine that merely has a GPU, a CPU rank would create a CUDA context, or fail in a forked process)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def snapshot(obj, pinned: dict | None = None, key: tuple = ()):
    """`obj` (a state dict) with every tensor copied to host memory: what a background write reads
    while training goes on changing the live tensors. With `pinned` (a dict kept across calls), GPU
    tensors go into page-locked buffers reused from one checkpoint to the next: one DMA at ~20 GB/s
    instead of pageable copies at ~2 GB/s (an 8B drafter's 17 GB state: 9 s of training paused)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if pinned is None or t.device.type != "cuda":
            return t.to("cpu", copy=True)
        buf = pinned.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = pinned[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return buf.copy_(t, non_blocking=True)  # the caller synchronises once, after all of them
    if isinstance(obj, Mapping):  # one value at a time: a mapping may make each as it is read (named_master)
        return {k: snapshot(v, pinned, key + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v, pinned, key + (i,)) for i, v in enumerate(obj))
    return obj


class Checkpointer:
    """One drafter rank's side of the checkpoint protocol.

    Every drafter writes its own RNG state (anchor sampling differs per rank, so a resumed rank must
    draw what the uninterrupted one would have); the role leader writes the trainer state (identical
    on every rank); after a barrier over `group` the leader commits the manifest. `state` is anything
    with `state_dict()` / `load_state_dict()` (the `DrafterTrainer`). `manifest`: extra facts recorded
    with every checkpoint (topology, run id); `fault`: tests kill a rank between two files of one save.

    Training does not wait for the write: `save` copies the trainer state to host memory (the only
    stall) and the leader writes and commits it on a thread of its own; the next `save`, and `wait`,
    wait for it first. The commit is still the manifest-last rename, so a kill at any moment leaves
    the previous complete checkpoint the newest. `last_s`: how long the last save took, copy and write.
    """

    def __init__(self, root: str, rank: int, leader: bool, group, keep: int, manifest: dict | None = None,
                 fault=None, guard=None):
        self.root, self.rank, self.leader, self.group, self.keep = root, rank, leader, group, keep
        self.manifest = dict(manifest or {})
        self.fault = fault
        # guard(what): a context the write runs in (StopSignal.protect: a stop lets it finish).
        self.guard = guard or (lambda what: contextlib.nullcontext())
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_s = 0.0
        self.stall_s = 0.0  # how long the last save held training up (the host copy)
        self._pinned: dict = {}  # host buffers of the snapshot, reused by every save (its write is over by then)
        self._warned_interval = False

    def resolve(self, resume: str) -> tuple[int, str | None]:
        return resume_point(resume, self.root)

    def save(self, state, step: int, num_steps: int, wait: bool = False) -> None:
        """Collective over `group`: every drafter rank calls it at the same step. Returns once the
        state is copied (the leader's write goes on in the background), or written with `wait`. The
        collective runs under `guard` on every rank: a rank at the barrier waits for the leader's
        previous write, which a stop lets finish, so the stop must not cut the waiting rank short."""
        with self.guard(f"the checkpoint of step {step}"):
            self._save(state, step, num_steps)
        if wait:
            self.wait()

    def _save(self, state, step: int, num_steps: int) -> None:
        t0 = time.monotonic()  # the pause counts the wait for the previous write too
        self.wait()
        waited = time.monotonic() - t0
        if self.leader and waited > 1.0 and not self._warned_interval:
            self._warned_interval = True
            log.warning("checkpoint of step %d waited %.1f s for the previous one's write (%.1f s a checkpoint): "
                        "checkpoint.every is shorter than a write takes, so training pauses at every save; raise "
                        "checkpoint.every (warned once)", step, waited, self.last_s or waited)
        tmp = tmp_dir(self.root, step)
        os.makedirs(tmp, exist_ok=True)
        save_file(get_rng_state(), os.path.join(tmp, rng_file(self.rank)))
        maybe_fault(self.fault, self.rank, step, "checkpoint")
        data = None
        if self.leader:
            data = snapshot(state.state_dict(), self._pinned)
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # the copies into the pinned buffers are done
        dist.barrier(group=self.group)  # every rank's RNG file is on disk
        self.stall_s = time.monotonic() - t0  # what training waits for: the host copy, not the write
        if self.leader:
            log.info("checkpoint of step %d: training paused %.2f s (the previous write, the host copy); written "
                     "behind it",
                     step, self.stall_s)
            manifest = {"num_steps": num_steps, **self.manifest}
            self._writer = threading.Thread(target=self._write, args=(data, tmp, step, manifest, t0),
                                            name=f"dflash-checkpoint-{step}", daemon=True)
            self._writer.start()
        else:
            self.last_s = time.monotonic() - t0

    def _write(self, data: dict, tmp: str, step: int, manifest: dict, t0: float) -> None:
        try:
            with self.guard(f"writing the checkpoint of step {step}"):
                maybe_fault(self.fault, self.rank, step, "slow_checkpoint")
                save_file(data, os.path.join(tmp, "drafter.pt"))
                commit(self.root, step, manifest, self.keep)
            self.last_s = time.monotonic() - t0
            log.info("checkpoint of step %d written in %.1f s", step, self.last_s)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = e

    def close(self) -> None:
        """Let a write under way finish (a failing run still leaves its last checkpoint whole)."""
        try:
            self.wait()
        except RuntimeError as e:
            log.error("%s", e)

    def wait(self) -> None:
        """Until the last save is on disk; raises what its write raised."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint under {self.root} failed: {error}") from error

    def load(self, path: str, state) -> int:
        """Restore `state` and this rank's RNG from checkpoint `path`; returns its step. The state is read
        into host memory and `state` copies it in a tensor at a time: a drafter's fp32 master and moments
        (12 bytes a parameter) never sit on the GPU beside their live copies."""
        step = int(read_manifest(path)["step"])
        state.load_state_dict(load_file(path, "drafter.pt"))
        set_rng_state(load_file(path, rng_file(self.rank)))
        return step
