"""One command-line dialect: every tool composes its typed node with the job config through Hydra,
answers --help with its options, and refuses a bad key or value with the key and the fix."""

import os
import subprocess
import sys

import pytest

from dflash_mp import dump, evaluate, plan, regenerate
from dflash_mp.config import JobConfig, compose

SRC = os.path.join(os.path.dirname(__file__), "..", "src")

# (module, node, its options dataclass, the function its command line ends in, an int option)
TOOLS = [
    (plan, "plan", plan.PlanConfig, "run_plan", "world_size"),
    (dump, "dump", dump.DumpConfig, "run_dump", "batches_per_shard"),
    (regenerate, "regen", regenerate.RegenConfig, "regenerate_file", "batch_size"),
    (evaluate, "eval", evaluate.EvalConfig, "evaluate", "num_prompts"),
]
IDS = [t[1] for t in TOOLS]


def command(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("tool", TOOLS, ids=IDS)
def test_help_exits_zero_and_names_every_option(tool):
    module, node, schema, _, _ = tool
    out = command(module.__name__, "--help")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert f"usage: python -m {module.__name__}" in out.stdout
    for name in schema.__dataclass_fields__:
        assert f"{node}.{name}=" in out.stdout, name
    assert module.__doc__.strip().splitlines()[0] in out.stdout  # what the tool does


def test_main_help_shows_the_job_options_and_the_tools():
    out = command("dflash_mp.main", "--help")
    assert out.returncode == 0, out.stderr
    for text in ("usage: torchrun", "experiment:", "seq_len:", "num_target_ranks:", "lr:"):
        assert text in out.stdout, text
    for module, node, *_ in TOOLS:
        assert f"python -m {module.__name__}" in out.stdout and f"{node}.*" in out.stdout


@pytest.mark.parametrize("tool", TOOLS, ids=IDS)
def test_bad_key_names_the_key_and_the_options(tool):
    module, node, schema, _, _ = tool
    with pytest.raises(ValueError) as err:
        module.main([f"{node}.bogus=1"])
    msg = str(err.value)
    assert f"full_key: {node}.bogus" in msg
    assert f"fix: '{node}.bogus' is not a setting; {node} has " in msg
    assert all(f"{node}.{name}" in msg for name in schema.__dataclass_fields__)


@pytest.mark.parametrize("tool", TOOLS, ids=IDS)
def test_bad_type_names_the_key_and_the_type(tool):
    module, node, schema, _, key = tool
    with pytest.raises(ValueError) as err:
        module.main([f"{key}=many"])  # the short form reaches the same node
    msg = str(err.value)
    assert "Value 'many' of type 'str' could not be converted to Integer" in msg
    default = schema.__dataclass_fields__[key].default
    assert f"fix: {node}.{key} takes a value of type int, e.g. its default: {node}.{key}={default}" in msg


def test_job_keys_are_checked_as_the_job_checks_them():
    # The job's own message for a bad key, and the tool's: the same Hydra text, the tool adding the fix.
    job = command("dflash_mp.main", "train.bogus=1")
    assert job.returncode != 0 and "Key 'bogus' not in 'TrainConfig'" in job.stderr
    tool = command("dflash_mp.plan", "train.bogus=1")
    assert tool.returncode == 1 and "Traceback" not in tool.stderr
    assert tool.stderr.startswith("error: Could not override 'train.bogus'.")
    assert "Key 'bogus' not in 'TrainConfig'" in tool.stderr and "fix: 'train.bogus' is not a setting" in tool.stderr
    assert "train.lr" in tool.stderr
    with pytest.raises(ValueError, match=r"(?s)full_key: train\.lr.*fix: train\.lr takes a value of type float"):
        plan.main(["train.lr=fast"])


def test_a_flag_is_refused_with_the_override_to_write():
    with pytest.raises(ValueError, match=r"--measure: .*write plan\.measure=true"):
        plan.main(["--measure"])
    with pytest.raises(ValueError, match=r"--bogus: .*--help"):
        regenerate.main(["--bogus"])


@pytest.mark.parametrize("tool", TOOLS, ids=IDS)
def test_options_reach_the_run_function_typed(tool, monkeypatch):
    module, node, schema, run_name, key = tool
    seen = {}

    def fake_run(job, cfg):
        seen["job"], seen["cfg"] = job, cfg
        return None if module is not regenerate else {}

    monkeypatch.setattr(module, run_name, fake_run)
    # Required options of the tools whose checks run before the run function.
    extra = {"dump": ["dump.dir=/tmp/x"]}.get(node, [])
    module.main([f"{node}.{key}=3", "data.seq_len=128", "train.lr=0.5", *extra])
    job, cfg = seen["job"], seen["cfg"]
    assert type(job) is JobConfig and type(cfg) is schema
    assert getattr(cfg, key) == 3 and type(getattr(cfg, key)) is int
    assert (job.data.seq_len, job.train.lr) == (128, 0.5) and type(job.train.lr) is float


def test_plan_options_typed_short_and_long_forms_agree(monkeypatch):
    seen = []
    monkeypatch.setattr(plan, "run_plan", lambda job, cfg: seen.append(cfg))
    plan.main(["world_size=4", "peak_tflops=500", "measure=true", "experiment=qwen3_8b"])
    plan.main(["plan.world_size=4", "plan.peak_tflops=500", "plan.measure=true", "experiment=qwen3_8b"])
    assert seen[0] == seen[1] == plan.PlanConfig(world_size=4, peak_tflops=500.0, measure=True)
    assert type(seen[0].peak_tflops) is float and seen[0].measure is True


def test_the_plain_job_schema_is_back_after_a_tool_composes():
    from dflash_mp.cli import compose_tool

    compose_tool("eval", evaluate.EvalConfig, ["eval.num_prompts=2"])
    job = compose([])
    assert type(job) is JobConfig and not hasattr(job, "eval")


def test_a_user_error_is_one_line_not_a_traceback():
    out = command("dflash_mp.regenerate", "regen.batch_size=lots")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: Error merging override regen.batch_size=lots")
    assert "fix: regen.batch_size takes a value of type int" in out.stderr
