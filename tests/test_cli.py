"""One command-line dialect: every tool composes its typed node with the job config through Hydra,
answers --help with its options, and refuses a bad key or value with the key and the fix."""

import os
import subprocess
import sys
import typing

import pytest

from dflash_mp import dump, evaluate, plan, reference, regenerate
from dflash_mp.builtin import __main__ as builtin_cli
from dflash_mp.builtin import proof
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


# The commands that took argparse flags, in the same dialect: (command line, node, options dataclass,
# an int option)
CONVERTED = [
    (["dflash_mp.reference"], "reference", reference.ReferenceConfig, "world_size"),
    (["dflash_mp.builtin.proof"], "proof", proof.ProofConfig, "world_size"),
    (["dflash_mp.builtin", "make-data"], "make_data", builtin_cli.MakeDataConfig, "num"),
    (["dflash_mp.builtin", "build-target"], "build_target", builtin_cli.BuildTargetConfig, "seed"),
    (["dflash_mp.builtin", "build-learned"], "build_learned", builtin_cli.BuildLearnedConfig, None),
]
CONVERTED_IDS = [c[1] for c in CONVERTED]


def converted_main(cmd: list[str], argv: list[str]):
    if cmd[0] == "dflash_mp.reference":
        return reference.main(argv)
    if cmd[0] == "dflash_mp.builtin.proof":
        return proof.main(argv)
    return builtin_cli.main([cmd[1], *argv])


@pytest.mark.parametrize("conv", CONVERTED, ids=CONVERTED_IDS)
def test_converted_commands_answer_help_naming_their_options(conv):
    cmd, node, schema, _ = conv
    out = command(*cmd, "--help")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith(f"usage: python -m {' '.join(cmd)} [{node}.KEY=VALUE ...]")
    for name in schema.__dataclass_fields__:
        assert f"{node}.{name}=" in out.stdout, name
    # A command that reads no job says so, instead of offering job overrides it would ignore.
    assert ("JOB OVERRIDES" in out.stdout) == (cmd[0] != "dflash_mp.builtin")


def test_builtin_help_lists_its_commands_and_the_job_help_lists_the_tools():
    out = command("dflash_mp.builtin", "--help")
    assert out.returncode == 0, out.stderr
    for name, node in (("make-data", "make_data"), ("build-target", "build_target"),
                       ("build-learned", "build_learned")):
        assert f"  {name}" in out.stdout and f"{node}.*" in out.stdout
    main_help = command("dflash_mp.main", "--help").stdout
    for text in ("python -m dflash_mp.reference", "reference.*", "python -m dflash_mp.builtin.proof", "proof.*",
                 "python -m dflash_mp.builtin make-data|build-target|build-learned"):
        assert text in main_help, text


@pytest.mark.parametrize("conv", CONVERTED, ids=CONVERTED_IDS)
def test_converted_commands_refuse_a_bad_key_a_bad_type_and_a_flag(conv):
    cmd, node, schema, key = conv
    with pytest.raises(ValueError) as err:
        converted_main(cmd, [f"{node}.bogus=1"])
    assert f"fix: '{node}.bogus' is not a setting; {node} has " in str(err.value)
    assert all(f"{node}.{name}" in str(err.value) for name in schema.__dataclass_fields__)
    if key is not None:
        with pytest.raises(ValueError, match=rf"(?s)could not be converted to Integer.*"
                                             rf"fix: {node}\.{key} takes a value of type int"):
            converted_main(cmd, [f"{key}=many"])
    flag = next(iter(schema.__dataclass_fields__))
    kind = typing.get_type_hints(schema)[flag].__name__
    with pytest.raises(ValueError, match=rf"--{flag}: options are key=value overrides, not flags; "
                                         rf"write {node}\.{flag}=<{kind}>"):
        converted_main(cmd, [f"--{flag}", "x"])


def test_the_old_flags_are_refused_with_the_override_to_write():
    with pytest.raises(ValueError, match=r"--world-size: .*write reference\.world_size=<int>\."):
        reference.main(["--world-size", "3"])
    with pytest.raises(ValueError, match=r"--cache-dir: .*write build_learned\.cache_dir=<str>\."):
        builtin_cli.main(["build-learned", "--cache-dir", "/tmp"])


@pytest.mark.parametrize("argv, missing", [
    (lambda: reference.main(["train.max_steps=2"]), "reference.world_size=<int>"),
    (lambda: proof.main(["proof.size=tiny"]), "proof.work=<str>"),
    (lambda: builtin_cli.main(["build-target", "seed=1"]), "build_target.out=<str>"),
], ids=["reference", "proof", "build_target"])
def test_a_required_option_left_out_is_refused_by_name(argv, missing):
    key = missing.partition("=")[0]
    with pytest.raises(ValueError, match=rf"(?s)Missing mandatory value: {key}\n.*fix: {key} is required: "
                                         rf"add {missing}; \w"):
        argv()


def test_reference_options_reach_its_run_typed(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(reference, "reference_run", lambda job, w: seen.update(job=job, w=w) or {"losses": [1.5]})
    reference.main(["world_size=3", "train.max_steps=2", "data.seq_len=128"])
    assert type(seen["job"]) is JobConfig and (seen["job"].train.max_steps, seen["job"].data.seq_len) == (2, 128)
    assert seen["w"] == 3 and type(seen["w"]) is int
    assert capsys.readouterr().out.strip() == '{"losses": [1.5]}'
    with pytest.raises(ValueError, match=r"reference\.world_size=1: .*use 2 or more"):
        reference.main(["reference.world_size=1"])


def test_proof_options_reach_its_run_typed_and_job_overrides_go_to_training(monkeypatch, tmp_path):
    seen = {}

    def fake_pipeline(work, size, world, extra_train, **settings):
        seen.update(work=work, size=size, world=world, train=extra_train, settings=settings)
        live = {"tau": 1.0, "lossless": True}
        return {"trained": {"sim": {"tau_sim": 1.0, "tau_sim_anchors": 1.0}, "live": live}, "timings": {}}

    monkeypatch.setattr(proof, "run_pipeline", fake_pipeline)
    proof.main([f"proof.work={tmp_path}", "size=medium", "rows=40", "proof.epochs=2", "world_size=3",
                "regen_cache=dynamic", "train.feature_noise=gaussian", "drafter.num_anchors=32"])
    assert seen == {"work": str(tmp_path), "size": "medium", "world": 3,
                    "train": ["train.feature_noise=gaussian", "drafter.num_anchors=32"],
                    "settings": {"num_rows": 40, "train_epochs": 2.0, "regen_cache": "dynamic"}}
    assert type(seen["settings"]["train_epochs"]) is float
    assert (tmp_path / "reports.json").exists()
    # A job override is checked before anything runs: the pipeline takes minutes.
    seen.clear()
    with pytest.raises(ValueError, match=r"(?s)Key 'bogus' not in 'TrainConfig'.*fix: 'train\.bogus' is not"):
        proof.main([f"proof.work={tmp_path}", "train.bogus=1"])
    with pytest.raises(ValueError, match=r"proof\.size='huge' is not a size; use one of tiny, medium"):
        proof.main([f"proof.work={tmp_path}", "proof.size=huge"])
    assert seen == {}


def test_builtin_commands_get_their_options_typed_and_refuse_job_overrides(monkeypatch, tmp_path, capsys):
    seen = []
    for name in ("make_data", "build_target", "build_learned"):
        monkeypatch.setattr(builtin_cli, name, lambda opts: seen.append(opts) or "done")
    builtin_cli.main(["make-data", f"make_data.out={tmp_path}/d.jsonl", "num=40", "make_data.turns=3"])
    builtin_cli.main(["build-target", "build_target.out=/tmp/t", "seed=2"])
    builtin_cli.main(["build-learned", "size=medium"])
    assert seen == [builtin_cli.MakeDataConfig(out=f"{tmp_path}/d.jsonl", num=40, turns=3),
                    builtin_cli.BuildTargetConfig(out="/tmp/t", seed=2),
                    builtin_cli.BuildLearnedConfig(size="medium")]
    assert [type(o) for o in seen] == [builtin_cli.MakeDataConfig, builtin_cli.BuildTargetConfig,
                                       builtin_cli.BuildLearnedConfig]
    assert type(seen[0].num) is int and capsys.readouterr().out.splitlines() == ["done"] * 3
    # They read no job: a job key would be ignored silently, so it is refused, naming their settings.
    with pytest.raises(ValueError, match=r"'train\.lr' is not a setting of `python -m dflash_mp\.builtin "
                                         r"make-data`, which reads no job config; its settings are make_data\.out"):
        builtin_cli.main(["make-data", "train.lr=1"])
    with pytest.raises(ValueError, match=r"'bogus' is not a command of python -m dflash_mp\.builtin: use one of "
                                         r"make-data, build-target, build-learned"):
        builtin_cli.main(["bogus"])
    with pytest.raises(ValueError, match=r"name a command: .*make-data, build-target, build-learned"):
        builtin_cli.main([])
    assert len(seen) == 3


def test_builtin_commands_check_their_values(tmp_path):
    with pytest.raises(ValueError, match=r"make_data\.turns=0: use 1"):
        builtin_cli.main(["make-data", f"make_data.out={tmp_path}/d.jsonl", "make_data.turns=0"])
    with pytest.raises(ValueError, match=r"build_learned\.size='huge' is not a size; use one of tiny, medium"):
        builtin_cli.main(["build-learned", "build_learned.size=huge"])


def test_a_converted_command_errs_in_one_line_and_reaches_its_work(tmp_path):
    out = command("dflash_mp.builtin", "make-data", "make_data.num=lots")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: Error merging override make_data.num=lots")
    made = command("dflash_mp.builtin", "make-data", f"make_data.out={tmp_path}/d.jsonl", "num=7", "turns=2")
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == f"{tmp_path}/d.jsonl" and len((tmp_path / "d.jsonl").read_text().splitlines()) == 7
