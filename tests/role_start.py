"""What a role's process has set when its run would start: run_target / run_drafter called on a CUDA
context, stopped where TargetRun / DrafterRun would take over (their first GEMM, their first compile)."""

import types

import pytest
import torch

from dflash_mp import blas, reductions, roles


def state_at_run_start(monkeypatch, role: str, target, train, read):
    """`read()` at the point run_target (`role="target"`) or run_drafter (`"drafter"`) hands over to its run,
    with the job's `target` and `train` configs. The process-wide state the roles set (the cuBLAS variables,
    Inductor's flag) is restored after the test; the variables start unset."""
    for name in blas.NO_WORKSPACE:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(reductions._configs(), reductions.FLAG, getattr(reductions._configs(), reductions.FLAG))
    seen = []

    class Stop(Exception):
        pass

    def started(ctx):
        seen.append(read())
        raise Stop

    run, cls = (roles.run_target, "TargetRun") if role == "target" else (roles.run_drafter, "DrafterRun")
    monkeypatch.setattr(roles, cls, started)
    ctx = types.SimpleNamespace(job=types.SimpleNamespace(target=target, train=train), device=torch.device("cuda", 0))
    with pytest.raises(Stop):
        run(ctx)
    return seen[0]
