"""`target.reduction_configs` and `train.reduction_configs`: a target's and a drafter's process have
Inductor pick each reduction kernel's config from its shape, untimed, unless told otherwise, set before
the process compiles."""

import pytest
import torch

from dflash_mp import reductions
from dflash_mp.target import TargetConfig
from dflash_mp.trainer import TrainConfig

import triton_interp
from role_start import state_at_run_start


@pytest.fixture
def flag(monkeypatch):
    """Inductor's flag as the test found it, restored after it (it is process-wide)."""
    monkeypatch.setattr(reductions._configs(), reductions.FLAG, False)
    return monkeypatch


def current() -> bool:
    return getattr(reductions._configs(), reductions.FLAG)


def test_this_torch_has_the_flag():
    """The choice rests on one Inductor option; a torch without it would run every reduction timed."""
    assert hasattr(reductions._configs(), reductions.FLAG)


def test_heuristic_is_the_default_and_sets_inductors_flag_on_cuda(flag):
    assert TargetConfig().reduction_configs == "heuristic" and TrainConfig().reduction_configs == "heuristic"
    how = reductions.use_picks("heuristic", torch.device("cuda", 0), "target.reduction_configs")
    assert current() is True
    assert how.startswith("heuristic") and reductions.describe("cuda") == how


def test_timed_clears_it_and_cpu_leaves_it(flag):
    reductions.use_picks("heuristic", "cuda", "train.reduction_configs")
    assert reductions.use_picks("timed", "cuda", "train.reduction_configs").startswith("timed")
    assert current() is False
    assert reductions.use_picks("heuristic", "cpu", "train.reduction_configs") == "n/a (not CUDA)"
    assert current() is False


def test_a_bad_choice_names_the_value_and_the_choices(flag):
    with pytest.raises(ValueError, match=r"target.reduction_configs='fast'.*heuristic.*timed"):
        reductions.use_picks("fast", "cuda", "target.reduction_configs")
    with pytest.raises(ValueError, match=r"train.reduction_configs='auto'.*heuristic.*timed"):
        reductions.use_picks("auto", "cuda", "train.reduction_configs")
    assert current() is False


@pytest.mark.parametrize("role", ["target", "drafter"])
def test_each_role_sets_it_before_its_run_starts(flag, role):
    """run_target and run_drafter apply their option before TargetRun / DrafterRun, which compile; `timed`
    in the other role's option shows each role reads its own."""
    target, train = TargetConfig(), TrainConfig()
    (train if role == "target" else target).reduction_configs = "timed"
    assert state_at_run_start(flag, role, target, train, current) is True


def configs_kept(choice: str) -> list:
    """In a process with Triton: the configs Inductor's heuristics keep for the 8B target's key-norm
    kernel (3072 x 40 rows of 128, a persistent reduction) with the flag as `choice` sets it."""
    from torch._inductor import config
    from torch._inductor.runtime import triton_heuristics as th
    from torch._inductor.runtime.hints import DeviceProperties, ReductionHint

    reductions.use_picks(choice, "cuda", "target.reduction_configs")
    meta = {reductions.FLAG: getattr(config.test_configs, reductions.FLAG)}  # as Inductor's codegen passes it
    triton_meta = {"device": DeviceProperties.create(torch.device("cpu"))}
    configs = th._persistent_reduction_configs({"x": 3072 * 40, "r0_": 128}, ReductionHint.INNER, meta, triton_meta)
    kept = th.filter_reduction_configs_for_determinism(meta, configs)
    return [(c.kwargs["XBLOCK"], c.num_warps) for c in kept]


def print_kept() -> None:
    print("KEPT", configs_kept("timed"), configs_kept("heuristic"))


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
def test_inductor_keeps_one_config_per_reduction_under_heuristic():
    """Timed, Inductor keeps the kernel's three configs (1, 8 and 32 rows a program) and times them at its
    first run; heuristic leaves one (8 rows a program), which the GPU never times."""
    out = triton_interp.run("test_reductions", "print_kept()")
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("KEPT"))
    assert line == "KEPT [(1, 2), (8, 2), (32, 2)] [(8, 2)]", line
