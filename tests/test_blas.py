"""`target.cublas_workspace` and `train.cublas_workspace`: a target's and a drafter's process run their
GEMMs without a cuBLAS workspace unless told otherwise, set before the process's first GEMM, and a
variable the user set is left alone."""

import pytest
import torch

from dflash_mp import blas
from dflash_mp.target import TargetConfig
from dflash_mp.trainer import TrainConfig

from role_start import state_at_run_start

NAMES = tuple(blas.NO_WORKSPACE)


@pytest.fixture
def clean_env(monkeypatch):
    """The two variables unset, and whatever a test sets removed after it (setenv records their state,
    so monkeypatch restores it: a variable left set would reach later tests of the process)."""
    for name in NAMES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_none_runs_cublas_without_a_workspace_on_cuda(clean_env):
    assert TargetConfig().cublas_workspace == "none" and TrainConfig().cublas_workspace == "none"
    how = blas.use_workspace("none", torch.device("cuda", 0), "target.cublas_workspace")
    assert {n: blas.os.environ.get(n) for n in NAMES} == {"CUBLAS_WORKSPACE_CONFIG": ":0:1",
                                                          "CUBLASLT_WORKSPACE_SIZE": "0"}
    assert how.startswith("none") and blas.describe("cuda") == how


def test_torch_and_cpu_leave_the_environment_alone(clean_env):
    assert blas.use_workspace("torch", "cuda", "target.cublas_workspace") == "PyTorch's sizes"
    assert blas.use_workspace("none", "cpu", "target.cublas_workspace") == "n/a (not CUDA)"
    assert all(n not in blas.os.environ for n in NAMES)


def test_a_workspace_the_user_set_wins(clean_env):
    clean_env.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as set for deterministic GEMMs
    how = blas.use_workspace("none", "cuda", "target.cublas_workspace")
    assert blas.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in how and how.startswith("as set in the environment")


def test_a_bad_choice_names_the_value_and_the_choices(clean_env):
    with pytest.raises(ValueError, match=r"target.cublas_workspace='off'.*none.*torch"):
        blas.use_workspace("off", "cuda", "target.cublas_workspace")
    with pytest.raises(ValueError, match=r"train.cublas_workspace='lt'.*none.*torch"):
        blas.use_workspace("lt", "cuda", "train.cublas_workspace")


@pytest.mark.parametrize("role", ["target", "drafter"])
def test_each_role_sets_it_before_its_run_starts(clean_env, role):
    """run_target and run_drafter apply their option before TargetRun / DrafterRun, which run the process's
    first GEMMs (the target's load, the drafter's compile and steps); `torch` in the other role's option
    shows each role reads its own."""
    target, train = TargetConfig(), TrainConfig()
    (train if role == "target" else target).cublas_workspace = "torch"
    seen = state_at_run_start(clean_env, role, target, train, lambda: {n: blas.os.environ.get(n) for n in NAMES})
    assert seen == blas.NO_WORKSPACE
