"""One CUDA graph's capture and replay, shared by the target's forward (target/graph.py) and the
drafter's training step (step_graph.py).

The work runs on the graph's own stream, launched or replayed (`on_stream`), so the launched calls
before a capture are its warm-up on that stream (cuBLAS workspaces, kernel loads, compiled graphs)
and nothing lazy happens inside the capture. A replay copies its inputs into the captured ones; its
outputs are the capture's own tensors, which the next replay overwrites.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

import torch

log = logging.getLogger(__name__)


def signature(inputs) -> tuple:
    """Shapes and dtypes (None for an absent input): a graph replays only inputs of its own signature."""
    return tuple(None if t is None else (tuple(t.shape), t.dtype) for t in inputs)


def describe(e: BaseException) -> str:
    """A failed capture in one line, for the log and the choices table."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def capture_failed(what: str, e: BaseException, fallback: str, fix: str) -> str:
    """Log a failed capture of `what`, which the caller runs `fallback` from then on; returns the
    failure in one line. `fix`: the setting that skips the capture."""
    why = describe(e)
    log.warning("%s: the CUDA graph capture failed (%s); running %s. %s skips the capture.",
                what, why, fallback, fix)
    return why


def describe_state(graph, why_off: str | None, on: str, fallback: str) -> str:
    """A CUDA graph's state for the log and the choices table: off and why (`graph` None), its capture
    failed (`graph.failed`) and `fallback` runs instead, or on as `on` says."""
    if graph is None:
        return f"off ({why_off})"
    if graph.failed is not None:
        return f"off (the capture failed: {graph.failed}; {fallback})"
    return f"on ({on})"


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream, device: torch.device) -> Iterator[torch.cuda.Stream]:
    """Runs the block on `stream`, ordered after the current stream's work so far and before its work
    to come. Yields the caller's stream (tensors made on `stream` that it reads: `record_stream`)."""
    cur = torch.cuda.current_stream(device)
    stream.wait_stream(cur)
    with torch.cuda.stream(stream):
        yield cur
    cur.wait_stream(stream)


class Captured:
    """`fn(*inputs)` captured as one CUDA graph on `stream` (in `pool` if given), over clones of the
    inputs (None stays None); `outputs` is what `fn` returned in the capture. Raises RuntimeError
    where the capture fails."""

    def __init__(self, fn: Callable, inputs, stream: torch.cuda.Stream, pool=None):
        self.static: list[torch.Tensor | None] = [None if t is None else t.clone() for t in inputs]
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (transport, liveness) may touch CUDA meanwhile.
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self.outputs = fn(*self.static)

    def replay(self, inputs):
        """Copy `inputs` into the captured ones and launch the graph; returns `outputs`."""
        for s, t in zip(self.static, inputs):
            if s is not None:
                s.copy_(t, non_blocking=True)
        self.graph.replay()
        return self.outputs
