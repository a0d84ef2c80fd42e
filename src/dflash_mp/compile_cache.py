"""Compiled once, reused: a role's compiled graphs saved under the run directory and loaded at start.

torch's portable compile caches (`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`:
Inductor's FX graphs, autotuning choices, Triton kernels) are written by each role's leader once its
warm-up has compiled everything, to `<run_dir>/compile_cache/<role>-torch<version>-<device>-<code>.bin`,
and loaded by every rank of that role before its first compiled call. A restarted job, the other
nodes of a job that shares its run directory, and a node with an empty `TORCHINDUCTOR_CACHE_DIR` then
look the graphs up instead of compiling them (an 8B drafter: minutes). Graphs are found by their own
hashes, and what does not match is compiled as usual; but those hashes do not cover a custom op's
declared outputs (its fake implementation), so a graph saved by other code could be reused against a
changed op. `<code>` (a hash of this package's sources) keeps each version of the code to its own file.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import os
import re
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@functools.cache
def code_stamp(root: str | None = None) -> str:
    """10 hex digits of a hash over the package's Python sources (paths and contents)."""
    base = Path(root or Path(__file__).parent)
    h = hashlib.sha1()
    for f in sorted(base.rglob("*.py")):
        h.update(str(f.relative_to(base)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:10]


def artifact_path(run_dir: str, role: str, device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{role}-torch{torch.__version__}-{where}-{code_stamp()}")
    return os.path.join(run_dir, "compile_cache", f"{tag}.bin")


def load(path: str) -> bool:
    """Pre-fill this process's compile caches from `path`; False when there is no such file or it
    cannot be read (a cache never stops a run: the graphs are compiled instead)."""
    if not os.path.isfile(path):
        return False
    t0 = time.monotonic()
    try:
        with open(path, "rb") as f:
            data = f.read()
        info = _load_all(data)  # None: torch found the bytes unusable
    except Exception as e:  # noqa: BLE001 - e.g. written by another torch build: compile instead
        info, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "torch could not use its contents"
    if info is None:
        log.warning("compile cache: could not load %s (%s); compiling instead", path, why)
        return False
    log.info("compile cache: loaded %.1f MB of compiled artifacts from %s in %.1f s",
             len(data) / 1e6, path, time.monotonic() - t0)
    return True


def _load_all(data: bytes):
    """`torch.compiler.load_cache_artifacts(data)`, but every saved record counts.

    Each `save_cache_artifacts()` call appends one record per artifact kind ("inductor",
    "aot_autograd", ...) to the bytes it returns, and torch's reader keeps only the last record of
    each kind (`dict(records)`): a file written by a second save, as `save` is called after the first
    backward and again after warm-up, would give back only the graphs compiled between the two saves
    (a restarted 8B drafter compiled 9 of its 11 FX graphs again). Merge the records first."""
    try:
        from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache
        from torch.utils._appending_byte_serializer import AppendingByteSerializer
    except ImportError:  # private API moved: torch's own reader
        return torch.compiler.load_cache_artifacts(data)
    CacheArtifactManager._ensure_cache_artifacts_registered()
    merged: dict[str, list] = {}
    for kind, artifacts in AppendingByteSerializer.to_list(data, deserialize_fn=_deserialize_single_cache):
        merged.setdefault(kind, []).extend(artifacts)
    return CacheArtifactManager.populate_caches(merged) if merged else None


def save(path: str) -> bool:
    """Write what this process compiled so far to `path` (atomically); False when nothing was or the
    write failed (logged: the run goes on, later starts compile again)."""
    try:
        art = torch.compiler.save_cache_artifacts()
        if art is None or not art[0]:
            return False
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(art[0])
        os.replace(tmp, path)  # readers never see half a file
    except Exception as e:  # noqa: BLE001 - a cache is an optimisation, never a reason to stop training
        log.warning("compile cache: could not save %s (%s: %s)", path, type(e).__name__, e)
        return False
    log.info("compile cache: saved %.1f MB of compiled artifacts to %s", len(art[0]) / 1e6, path)
    return True


class SharedCompile:
    """On a node, one rank of a role compiles and the others load what it compiled.

    Ranks of one role on one node compile the same graphs; side by side they would each spend the
    whole compile (minutes for an 8B drafter) competing for the same CPU cores. The node's first rank
    of the role (`leader`) compiles, saves its artifacts and says so in the store (`compiled()`); the
    others wait for that word (`before_compile()`), load the artifacts and find their graphs compiled.
    The leader publishes once its first forward and backward are compiled, before the first
    collective, so the wait cannot deadlock against the gradient all-reduce. A leader that saves
    nothing still publishes: its followers then compile themselves. The wait itself is bounded by
    the caller's liveness watcher (the leader is 'compiling', a busy phase with its own bound).
    """

    def __init__(self, path: str, store, key: str, leader: bool, wait_s: float = 24 * 3600.0):
        self.path, self.store, self.key, self.leader, self.wait_s = path, store, key, leader, wait_s
        self.done = False

    def before_compile(self) -> bool:
        """Leader: pre-fill from an earlier attempt's artifacts. Follower: wait for the leader's,
        then load them. True when artifacts were loaded."""
        if self.leader:
            return load(self.path)
        t0 = time.monotonic()
        self.store.wait([self.key], datetime.timedelta(seconds=self.wait_s))
        log.info("compile cache: waited %.1f s for the node's compiling rank", time.monotonic() - t0)
        return load(self.path)

    def compiled(self) -> None:
        """Leader, once: save what this process compiled and release the followers."""
        if self.done:
            return
        self.done = True
        if self.leader:
            saved = save(self.path)
            self.store.set(self.key, "saved" if saved else "none")
