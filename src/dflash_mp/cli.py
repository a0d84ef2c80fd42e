"""The command line of every tool: Hydra overrides of the training job plus the tool's own typed node.

A tool (`plan`, `dump`, `regenerate`, `evaluate`) reads the job config the way `dflash_mp.main` does
(same `conf/`, same groups, same override grammar) with one more node, its options dataclass, under
its own key (`plan.world_size=8`, `eval.num_prompts=4`). A tool option may also be written without
the prefix (`world_size=8`, as the tools always took them): the short form is never ambiguous, since
no tool names an option after a top-level job scalar (`name`, `run_dir`), and a job section such as
`checkpoint` cannot be set to a bare value anyway.
A bad key or a value of the wrong type fails before the tool runs, with Hydra's message and the fix.
A tool that launches a job (`builtin.proof`) takes the job's overrides as they are, checked the same
way; one that reads no job (the `builtin` commands, one node per sub-command) takes only its node.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import re
import sys
import types
import typing
from typing import Any, Callable

from hydra import compose as hcompose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import (ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException,
                              ValidationError)

from .config import CONF_DIR, JobConfig


JOB_USES = ("config", "overrides", "none")


def tool_main(node: str, schema: type, run: Callable[..., Any], doc: str, argv: list[str] | None = None,
              job: str = "config", command: str | None = None) -> Any:
    """`python -m <tool> [--help] [overrides]`: compose, then run.

    `job` is what the tool does with the training job: "config" (it reads the job) calls
    `run(job, options)`; "overrides" (it launches a job of its own, `builtin.proof`) composes the job
    overrides only to check them before anything runs, then calls `run(options, overrides)` with them
    as typed; "none" (it reads no job, the `builtin` commands) refuses them and calls `run(options)`.
    Raises ValueError for a bad command line; `entry` turns it into one `error:` line."""
    assert job in JOB_USES, job
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command or "python -m " + _module_name(run)
    if "--help" in argv or "-h" in argv:
        print(tool_help(command, node, schema, doc, job))
        return None
    if job == "none":
        return run(compose_options(node, schema, argv, command))
    job_config, options = compose_tool(node, schema, argv, command)
    if job == "overrides":
        return run(options, split_overrides(node, schema, argv, command)[1])
    return run(job_config, options)


def commands_main(prog: str, commands: dict[str, tuple[str, type, Callable[[Any], Any], str]], doc: str,
                  argv: list[str] | None = None) -> Any:
    """`{prog} COMMAND [--help] [NODE.KEY=VALUE ...]`: a tool of several commands, named by the first
    argument, each with a node of its own (`commands[name] = (node, schema, run, doc)`) and no job."""
    argv = list(sys.argv[1:] if argv is None else argv)
    names = ", ".join(commands)
    if not argv or argv[0] in ("--help", "-h"):
        if argv:
            width, nodes = max(map(len, commands)), max(len(c[0]) for c in commands.values()) + 2
            rows = "\n".join(f"  {name:<{width}}  {node + '.*':<{nodes}}  {(sub or '').strip().splitlines()[0]}"
                              for name, (node, _, _, sub) in commands.items())
            print(f"usage: {prog} COMMAND [NODE.KEY=VALUE ...]\n\n{(doc or '').strip()}\n\n"
                  f"commands (each answers `{prog} COMMAND --help` with its options):\n{rows}")
            return None
        raise ValueError(f"name a command: `{prog} COMMAND ...` with COMMAND one of {names}; "
                         f"see `{prog} --help`.")
    name, rest = argv[0], argv[1:]
    if name not in commands:
        raise ValueError(f"{name!r} is not a command of {prog}: use one of {names} "
                         f"(`{prog} {next(iter(commands))} --help` lists its options).")
    node, schema, run, sub = commands[name]
    return tool_main(node, schema, run, sub, rest, job="none", command=f"{prog} {name}")


def _module_name(fn) -> str:
    mod = fn.__module__
    if mod == "__main__":  # `python -m dflash_mp.x`: the spec keeps the name the user typed
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        mod = spec.name if spec else mod
    return mod


def entry(main: Callable[[], Any]) -> None:
    """Run a tool's `main` as a command: a user error prints one `error:` line, not a traceback."""
    try:
        main()
    except ValueError as e:  # a user error: its message names the setting and the fix
        sys.exit(f"error: {e}")
    freeze_for_exit()


def freeze_for_exit() -> None:
    """Once a command has done its work: move every object the collector tracks to its permanent
    generation (gc.freeze), so the interpreter's teardown does not walk them again. A process that
    imported transformers and built a model tracks 250-470 thousand objects; the teardown's collections
    took about 1 s of every CPU rank's exit. Exit handlers (atexit, weakref.finalize), logging's flush
    and the destructors of objects freed by reference counting still run; objects held only by
    reference cycles are no longer finalized, so whatever must flush is closed explicitly before
    (the writers, the checkpoints, the shared-memory ring all are)."""
    gc.freeze()


def tool_schema(node: str, schema: type) -> type:
    """The job schema with the tool's node added: one typed tree, so Hydra checks both alike."""
    tool_field = (node, schema, dataclasses.field(default_factory=schema))
    return dataclasses.make_dataclass(f"{schema.__name__}Job", [tool_field], bases=(JobConfig,))


def split_overrides(node: str, schema: type, argv: list[str], command: str = "") -> tuple[list[str], list[str]]:
    """(the tool's overrides, under `node.`; the job's, as typed); ValueError for a flag, with the fix."""
    hints = typing.get_type_hints(schema)
    own, job = [], []
    for arg in argv:
        if arg.startswith("-"):
            name = arg.lstrip("-").partition("=")[0].replace("-", "_")
            value = "true" if hints.get(name) is bool else f"<{_type_name(hints.get(name))}>"
            fix = f"write {node}.{name}={value}" if name in hints else f"see `{command} --help`"
            raise ValueError(f"{arg}: options are key=value overrides, not flags; {fix}.")
        key = arg.partition("=")[0]
        if key in hints:
            own.append(f"{node}.{arg}")
        else:
            (own if key.startswith(node + ".") else job).append(arg)
    return own, job


def compose_tool(node: str, schema: type, argv: list[str], command: str = "") -> tuple[JobConfig, Any]:
    """(job config, tool options) from command-line overrides; ValueError naming the key and the fix."""
    own, job_overrides = split_overrides(node, schema, argv, command)
    full = tool_schema(node, schema)
    # Stored under the job's own name, so conf/config.yaml's defaults pick it up unchanged; every
    # composer registers its schema first (config.compose, main), so the job never sees this one.
    obj = _compose(full, "job_schema", "config", own + job_overrides, command)
    job = JobConfig(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(JobConfig)})
    return job, getattr(obj, node)


def compose_options(node: str, schema: type, argv: list[str], command: str = "") -> Any:
    """The options of a tool that reads no job: every override is one of its own."""
    own, other = split_overrides(node, schema, argv, command)
    if other:
        names = ", ".join(f"{node}.{n}" for n in _fields(schema))
        raise ValueError(f"{other[0]}: '{other[0].partition('=')[0]}' is not a setting of `{command}`, which "
                         f"reads no job config; its settings are {names} (see `{command} --help`).")
    full = dataclasses.make_dataclass(f"{schema.__name__}Options",
                                      [(node, schema, dataclasses.field(default_factory=schema))])
    return getattr(_compose(full, f"{node}_options", f"{node}_options", own, command), node)


def _compose(full: type, stored_as: str, config_name: str, overrides: list[str], command: str) -> Any:
    """Hydra's composition of `overrides` over `full`, as an object; ValueError naming the key and the fix."""
    ConfigStore.instance().store(name=stored_as, node=full)
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = hcompose(config_name=config_name, overrides=overrides)
        return OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(_explain(e, full, command)) from None


def _explain(err: Exception, full: type, command: str) -> str:
    """Hydra's message (the one the job prints) plus the fix, found in the schema."""
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    lines = [ln for ln in str(err).splitlines() if not ln.startswith("To append to your config")]
    internal = ("reference_type=", "object_type=")  # schema class names: noise to the user
    if cause is not err:
        lines += [ln for ln in str(cause).splitlines() if not ln.strip().startswith(internal)]
    key = getattr(cause, "full_key", None) or ""
    if isinstance(err, MissingMandatoryValue):  # its first line names the schema class, not the key
        lines = [f"Missing mandatory value: {key}"] + [ln for ln in lines[1:] if not ln.strip().startswith(internal)]
    parent_key, _, leaf = key.rpartition(".")
    parent = _node_type(full, parent_key)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and parent is not None:
        where = f"{parent_key}." if parent_key else ""
        names = ", ".join(where + n for n in _fields(parent))
        fix = f"'{key}' is not a setting; {parent_key or 'the config'} has {names}"
    elif isinstance(cause, MissingMandatoryValue) and parent is not None and leaf in _fields(parent):
        note = _comments(parent).get(leaf)
        fix = f"{key} is required: add {key}=<{_type_name(typing.get_type_hints(parent)[leaf])}>" + (
            f"; {note}" if note else "")
    elif isinstance(cause, ValidationError) and parent is not None and leaf in _fields(parent):
        kind, default = _type_name(typing.get_type_hints(parent)[leaf]), _default(_fields(parent)[leaf])
        fix = f"{key} takes a value of type {kind}" + (f", e.g. its default: {key}={default}" if default != "???" else "")
    else:
        fix = f"see `{command} --help` for the options"
    return "\n".join(lines + [f"fix: {fix}"])


def _node_type(root: type, key: str) -> type | None:
    """The dataclass at dotted `key` of the schema (None past a dict or a scalar)."""
    node = root
    for part in filter(None, key.split(".")):
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        node = hints.get(part)
    return node if dataclasses.is_dataclass(node) else None


def _fields(schema: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(schema)}


def _type_name(kind) -> str:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(kind))
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    """The default as it is written on the command line (YAML: null, true)."""
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "???"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    text = OmegaConf.to_yaml({"v": value}).strip()[len("v:"):].strip()
    return text if "\n" not in text else "(a node)"


def _comments(schema: type) -> dict[str, str]:
    """Each field's trailing `# ...` comment in the dataclass source: the options' documentation."""
    try:
        src = inspect.getsource(schema)
    except (OSError, TypeError):
        return {}
    pat = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.*)$")
    return {m.group(1): m.group(2) for m in map(pat.match, src.splitlines()) if m}


def tool_help(command: str, node: str, schema: type, doc: str, job: str = "config") -> str:
    hints, notes = typing.get_type_hints(schema), _comments(schema)
    rows = [(f"{node}.{f.name}={_default(f)}", _type_name(hints[f.name]), notes.get(f.name, ""))
            for f in dataclasses.fields(schema)]
    width = max(len(r[0]) for r in rows)
    kinds = max(len(r[1]) for r in rows)
    opts = "\n".join(f"  {a:<{width}}  {t:<{kinds}}  {n}".rstrip() for a, t, n in rows)
    required = "; ??? = required" if any(_default(f) == "???" for f in dataclasses.fields(schema)) else ""
    head = (f"usage: {command} [{node}.KEY=VALUE ...]{'' if job == 'none' else ' [JOB OVERRIDES ...]'}\n\n"
            f"{(doc or '').strip()}\n\n"
            f"options ({node}.*, with their defaults{required}; the `{node}.` prefix may be left off):\n{opts}\n\n")
    if job == "none":
        return head + "It reads no job config. A bad key or value fails before anything runs, naming the key and the fix."
    return (head + "job overrides: any key or group of the training job's config, in Hydra's grammar\n"
            "(experiment=NAME, target.path=..., data.seq_len=...); `python -m dflash_mp.main --help` lists\n"
            "them. A bad key or value fails before anything runs, naming the key and the fix.")
