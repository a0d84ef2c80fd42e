"""The target's forward replayed as one CUDA graph (`target.cuda_graph`, on by default).

A packed row has one shape for the whole run, so the forward (the row's visible ranges, the
embedding, every decoder layer and its kernels) is the same ~700 launches each time. Launched from
Python they cost the GPU its first milliseconds of every forward (the host starts it) and a gap
before many kernels; where the target takes turns with a drafter at one GPU (gpu_turns.py) each of
those milliseconds is the whole job's. Captured once, a forward is a few input copies and one
graph launch.

What can be captured: nothing in the forward may read a tensor's value on the host. The Triton
packed-document attention (doc_attn.py) builds its ranges on the GPU and launches fixed grids;
linear-attention layers take the row's document spans as host data (linear_attn.py), and MoE
layers in transformers pick their experts with data-dependent shapes, so those targets, and the
other attention kernels, whose masks were not built for capture, run uncaptured (`unsupported`).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..cuda_graph import Captured, capture_failed, on_stream, signature
from ..flops import num_experts

log = logging.getLogger(__name__)


def unsupported(device: torch.device, attention: str, linear: bool, config, compile_scope: str) -> str | None:
    """Why this target's forward cannot be captured (None: it can). `attention`: the implementation
    the worker runs ("triton", "flex_attention", ...); `linear`: it has linear-attention layers."""
    if device.type != "cuda":
        return "no GPU"
    if attention != "triton":
        return (f"attention {attention}: the capture is made for the Triton kernel "
                "(target.attn_implementation=auto or triton)")
    if linear:
        return "its linear-attention layers take the row's document spans as host data"
    if num_experts(config.get_text_config().to_dict()):
        return "its MoE layers pick their experts with data-dependent shapes"
    if compile_scope != "layers":
        return f"compile_scope={compile_scope} (compared, not captured)"
    return None


class ForwardGraph:
    """Replays `fn(*inputs) -> list of tensors` as a CUDA graph, one per input signature (shapes and
    dtypes; None for an absent input).

    Every call runs on the graph's own stream (cuda_graph.on_stream). A signature's first call runs
    `fn` launched (its result is returned) and is the warm-up on that stream: the capture follows
    directly, and lazy set-up (cuBLAS workspaces, kernel loads) has happened before it. Later calls
    copy their inputs into the graph's and replay it. The tensors a replay returns are the graph's
    own and the next replay overwrites them: the caller copies them out (TargetWorker concatenates
    them into the batch it sends). A capture that fails is logged and the forward runs uncaptured
    from then on.
    """

    def __init__(self, fn: Callable[..., list[torch.Tensor]], device: torch.device):
        self.fn, self.device = fn, device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool for every signature's graph
        self.graphs: dict[tuple, Captured] = {}
        self.failed: str | None = None
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor | None) -> list[torch.Tensor]:
        if self.failed is not None:
            return self.fn(*inputs)
        key = signature(inputs)
        with on_stream(self.stream, self.device) as caller:
            captured = self.graphs.get(key)
            if captured is not None:
                self.replays += 1
                return captured.replay(inputs)
            out = self.fn(*inputs)
            # Made on the graph's stream, read on the caller's: the allocator keeps their memory from
            # later work on the graph's stream until the caller's reads are done.
            for t in out:
                t.record_stream(caller)
            self._capture(key, inputs)
        return out

    def _capture(self, key: tuple, inputs) -> None:
        try:
            captured = Captured(self.fn, inputs, self.stream, self.pool)
        except RuntimeError as e:
            self.failed = capture_failed("target forward", e, "uncaptured", "target.cuda_graph=false")
            return
        self.graphs[key] = captured
        log.info("target forward: captured as a CUDA graph for inputs %s",
                 ", ".join("-" if k is None else str(list(k[0])) for k in key))
