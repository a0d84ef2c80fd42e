"""Helpers shared by processes of one machine: an inter-process lock, a directory written atomically,
and whether a process is still alive."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile


def write_atomic(out_dir: str, save) -> str:
    """`save(tmp)` into a private temp dir, then rename it to `out_dir` (a model directory). If
    another process won the race, its complete copy (one with a config.json) is kept."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-build-")
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the renamed cache should read like any directory
    try:
        save(tmp)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not os.path.isfile(os.path.join(out_dir, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


@contextlib.contextmanager
def file_lock(path: str):
    """An exclusive lock between processes of one machine (flock on `path`; the OS drops it if the
    holder dies)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def try_lock(path: str) -> int | None:
    """Take an exclusive flock on `path` without waiting: the open descriptor (keep it open for as
    long as the lock must hold; the kernel drops it when the process ends, however it ends), or None
    when another process holds it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def pid_alive(pid: int) -> bool:
    """Same-node liveness; a zombie (killed, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return True  # no /proc: os.kill already said it exists
