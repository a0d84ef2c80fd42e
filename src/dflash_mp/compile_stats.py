"""Compile and CUDA-graph counters, so "zero recompiles after warm-up" is measured, not assumed."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

import torch

_RECORDS = [0]
_INSTALLED = [False]
_MISMATCHES: dict[str, int] = {}


def _install() -> None:
    """Count CUDA graph recordings by wrapping CUDAGraph Trees' node constructor (one node is
    created per recording). Private API: if it moves, recordings read -1 rather than failing."""
    if _INSTALLED[0]:
        return
    _INSTALLED[0] = True
    if not torch.cuda.is_available():
        return  # nothing can record: 0, without importing CUDAGraph Trees (half a second of start-up)
    try:
        from torch._inductor import cudagraph_trees as cgt

        init = cgt.CUDAGraphNode.__init__

        def counting_init(self, *args, **kwargs):
            _RECORDS[0] += 1
            init(self, *args, **kwargs)

        cgt.CUDAGraphNode.__init__ = counting_init
        check = cgt.CUDAGraphNode.check_invariants

        def noting_check(self, *args, **kwargs):
            status, logger = check(self, *args, **kwargs)
            if status != cgt.CheckInvariantStatus.SUCCESS:
                name = getattr(status, "name", str(status))
                _MISMATCHES[name] = _MISMATCHES.get(name, 0) + 1
            return status, logger

        cgt.CUDAGraphNode.check_invariants = noting_check
    except (ImportError, AttributeError):
        _RECORDS[0] = -1


def _counters() -> defaultdict:
    """Dynamo's counters; all zero where Dynamo was never imported (nothing compiled: a drafter rank
    running eager on CPU need not import it, a second of its start-up, to read zeros)."""
    if "torch._dynamo" not in sys.modules:
        return defaultdict(Counter)
    from torch._dynamo.utils import counters

    return counters


def graph_mismatches() -> dict[str, int]:
    """Why recorded CUDA graphs could not be replayed so far ({reason: times}): each such miss is
    followed by a new recording. Private API: {} if it moved."""
    _install()
    return dict(_MISMATCHES)


def counts() -> dict[str, int]:
    """{"graphs": Dynamo graphs compiled so far, "cudagraph_records": CUDA graphs recorded so far}."""
    counters = _counters()
    _install()
    return {"graphs": int(counters["stats"]["unique_graphs"]), "cudagraph_records": _RECORDS[0]}


def cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache and AOTAutograd's cache so far: {"fx_hit", "fx_miss", "fx_bypass",
    "aot_hit", "aot_miss", "aot_bypass", "aot_saved"} (a miss is a graph compiled here; a hit one
    looked up, e.g. in loaded artifacts; a bypass one the cache cannot hold)."""
    counters = _counters()
    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {"fx_hit": int(ind["fxgraph_cache_hit"]), "fx_miss": int(ind["fxgraph_cache_miss"]),
            "fx_bypass": int(ind["fxgraph_cache_bypass"]), "aot_hit": int(aot["autograd_cache_hit"]),
            "aot_miss": int(aot["autograd_cache_miss"]), "aot_bypass": int(aot["autograd_cache_bypass"]),
            "aot_saved": int(aot["autograd_cache_saved"])}


def describe_cache(c: dict[str, int]) -> str:
    return (f"{c['fx_hit']} FX graphs looked up, {c['fx_miss']} compiled; AOTAutograd {c['aot_hit']} looked up, "
            f"{c['aot_miss']} compiled")
