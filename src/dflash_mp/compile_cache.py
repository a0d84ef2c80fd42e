"""Compiled once, reused: a role's compiled graphs saved under the run directory and loaded at start.

torch's portable compile caches (`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`:
Inductor's FX graphs, autotuning choices, Triton kernels) are written by each role's leader once its
warm-up has compiled everything, to `<run_dir>/compile_cache/<role>-torch<version>-<device>.bin`,
and loaded by every rank of that role before its first compiled call. A restarted job, the other
nodes of a job that shares its run directory, and a node with an empty `TORCHINDUCTOR_CACHE_DIR` then
look the graphs up instead of compiling them (an 8B drafter: minutes). A stale file costs nothing:
graphs are found by their own hashes, and what does not match is compiled as usual.
"""

from __future__ import annotations

import logging
import os
import re
import time

import torch

log = logging.getLogger(__name__)


def artifact_path(run_dir: str, role: str, device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{role}-torch{torch.__version__}-{where}")
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
        info = torch.compiler.load_cache_artifacts(data)  # None: torch found the bytes unusable
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
