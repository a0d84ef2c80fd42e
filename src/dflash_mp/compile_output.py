"""Native output of a compile goes to a file, not the console.

A compile writes through the process's file descriptors, not through Python: ptxas, the C++
compiler and Inductor's worker processes inherit fd 1 and 2, and one killed mid-compile can print a
hundred thousand lines of PTX. While a role compiles, fd 1 and 2 point at
`<run_dir>/logs/compile_rank_<N>.log`; Python's own output (logging, warnings, progress bars) keeps
the console through a duplicate of the original descriptors. Worker processes started meanwhile keep
the file for their lifetime, so later compiles of theirs land there too. The console gets one line
saying where the output went, and the last few lines of it when the compile fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections import deque
from collections.abc import Iterator

log = logging.getLogger(__name__)

TAIL_LINES = 20  # what a failed compile shows on the console; the file has the rest


def output_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "logs", f"compile_rank_{rank}.log")


def _console_holders() -> list[tuple[object, object]]:
    """(object, console stream) for every log handler that ends on stdout/stderr, through the
    wrappers that keep lines off progress bars (metrics.quiet_console): the object is the handler or
    the innermost wrapper, whose `stream` is the process's stdout/stderr."""
    consoles = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    found = []
    for h in logging.getLogger().handlers:
        if not isinstance(h, logging.StreamHandler) or isinstance(h, logging.FileHandler):
            continue
        holder, stream = h, h.stream
        while stream not in consoles and getattr(stream, "stream", stream) is not stream:
            holder, stream = stream, stream.stream
        if stream in consoles:
            found.append((holder, stream))
    return found


def _tail(path: str, start: int, n: int) -> tuple[int, list[str]]:
    """(lines written after byte `start`, the last `n` of them)."""
    lines, last = 0, deque(maxlen=n)
    with open(path, "rb") as f:
        f.seek(start)
        for raw in f:
            line = raw.decode(errors="replace")
            lines += 1
            last.append(line.rstrip("\n"))
    return lines, list(last)


@contextlib.contextmanager
def to_file(path: str, what: str = "compile") -> Iterator[str]:
    """Point fd 1 and 2 at `path` (appended) for the block; Python-level output stays on the console."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    console = {fd: os.fdopen(os.dup(saved[fd]), "w", buffering=1, errors="replace") for fd in (1, 2)}
    old_sys = sys.stdout, sys.stderr
    # Handlers that write to the process's stdout/stderr follow the console; file handlers stay.
    moved = _console_holders()
    start = os.path.getsize(path) if os.path.exists(path) else 0
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for fd in (1, 2):
            os.dup2(target, fd)
        sys.stdout, sys.stderr = console[1], console[2]
        for holder, stream in moved:
            holder.stream = console[2] if stream in (sys.__stderr__, old_sys[1]) else console[1]
        failed = False
        try:
            yield path
        except BaseException:
            failed = True
            raise
        finally:
            for stream in (*old_sys, console[1], console[2]):
                with contextlib.suppress(Exception):
                    stream.flush()
            for fd in (1, 2):
                os.dup2(saved[fd], fd)
            sys.stdout, sys.stderr = old_sys
            for holder, stream in moved:
                holder.stream = stream
            _report(path, start, what, failed)
    finally:
        os.close(target)
        for fd in (1, 2):
            os.close(saved[fd])
            console[fd].close()


def _report(path: str, start: int, what: str, failed: bool) -> None:
    if os.path.getsize(path) <= start:
        return
    lines, last = _tail(path, start, TAIL_LINES)
    if failed:
        log.error("%s failed: its native output (%d lines) is in %s; the last %d:\n%s", what, lines, path,
                  len(last), "\n".join(last))
    else:
        log.info("%s wrote %d lines of native output to %s", what, lines, path)
