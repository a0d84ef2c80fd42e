"""The drafter's training step replayed as one CUDA graph (`train.cuda_graph`, on by default).

A step has one shape for the whole run (fixed rows, fixed anchors), so forward, backward, the
gradient norm and the AdamW update are the same ~700 launches every time. Launched from Python
they leave the GPU a gap before many kernels (BENCHMARKS.md, calls J-O) and, where the
host waits for each step (GPU turns with a target), the host's start of the next. Captured once,
a step is five input copies and one graph launch.

Every step, launched or replayed, runs on the graph's own stream, so the launched steps before
the capture set up what that stream needs (cuBLAS workspaces, kernel loads, compiled graphs) and
nothing lazy happens inside the capture. The capture records the device work only: the host's
counters (steps, tokens, the learning rate's value) are kept outside it, and the random anchors
come from the generator's graph-safe state, so a replay draws what a launched step would have.
A capture that fails is logged and the steps run launched from then on.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .cuda_graph import Captured, capture_failed, on_stream, signature

log = logging.getLogger(__name__)

CAPTURE_AT = 3  # the first step captured (then replayed): two launched steps compile and warm up first


def unsupported(device: torch.device, mode: str, world: int, attention: str) -> str | None:
    """Why the step cannot be captured (None: it can). `mode`: the resolved train.compile; `world`:
    drafter replicas; `attention`: the drafter's resolved attention backend."""
    if device.type != "cuda":
        return "no GPU"
    if mode in ("reduce-overhead", "max-autotune"):
        return f"train.compile={mode} records CUDA graphs of its own"
    if world > 1:
        return f"{world} drafter replicas: the gradient all-reduce runs between backward and the update"
    if attention != "triton":
        return (f"drafter attention {attention}: the capture is made for the Triton block kernels "
                "(drafter.attention=auto or triton)")
    return None


class StepGraph:
    """Runs a training step's device work, `body(*inputs)`, launched for the first CAPTURE_AT - 1
    steps and then as a captured graph. The caller runs every step inside `on_stream()`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.graph: Captured | None = None
        self.failed: str | None = None
        self.steps = 0  # steps run, launched or replayed
        self.replays = 0

    def on_stream(self):
        """Around a whole step: it runs on the graph's stream, ordered after the caller's stream's
        work so far (the batch) and before its work to come (reads of the weights, the next batch)."""
        return on_stream(self.stream, self.device)

    @property
    def static(self) -> list[torch.Tensor]:
        """The captured graph's inputs (empty before the capture)."""
        return [] if self.graph is None else self.graph.static

    @property
    def launching(self) -> bool:
        """Whether the next step runs launched (before the capture, or after a failed one)."""
        return self.failed is not None or self.steps + 1 < CAPTURE_AT

    def fits(self, inputs: list[torch.Tensor]) -> bool:
        """Whether these inputs can go through the graph: before the capture any can; after it only
        the captured shapes and dtypes (a batch of another shape runs launched)."""
        return not self.static or signature(self.static) == signature(inputs)

    def launched(self) -> None:
        """Count a step the caller ran launched (on `stream`)."""
        self.steps += 1

    def run(self, body: Callable[..., None], inputs: list[torch.Tensor], undo: Callable[[], None]) -> bool:
        """This step through the graph: captured first if it is not yet. Returns False if the
        capture failed (after `undo()` has reset the host state the capture touched): the caller
        then runs the step launched."""
        if self.graph is None:
            try:  # (torch.cuda.graph gives the launched steps' cached memory back before it)
                self.graph = Captured(body, inputs, self.stream)
            except RuntimeError as e:
                self.failed = capture_failed("drafter step", e, "launched", "train.cuda_graph=false")
                undo()
                return False
            log.info("drafter step: captured as a CUDA graph at step %d", self.steps + 1)
        self.graph.replay(inputs)
        self.replays += 1
        self.steps += 1
        return True
