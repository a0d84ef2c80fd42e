"""The command line of every tool: Hydra overrides of the training job plus the tool's own typed node.

A tool (`plan`, `dump`, `regenerate`, `evaluate`) reads the job config the way `dflash_mp.main` does
(same `conf/`, same groups, same override grammar) with one more node, its options dataclass, under
its own key (`plan.world_size=8`, `eval.num_prompts=4`). A tool option may also be written without
the prefix (`world_size=8`, as the tools always took them): the short form is never ambiguous, since
no tool names an option after a top-level job scalar (`name`, `run_dir`), and a job section such as
`checkpoint` cannot be set to a bare value anyway.
A bad key or a value of the wrong type fails before the tool runs, with Hydra's message and the fix.
"""

from __future__ import annotations

import dataclasses
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
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from .config import CONF_DIR, JobConfig


def tool_main(node: str, schema: type, run: Callable[[JobConfig, Any], Any], doc: str,
              argv: list[str] | None = None) -> Any:
    """`python -m <tool> [--help] [overrides]`: compose, then `run(job, options)`.

    Raises ValueError for a bad command line; `entry` turns it into one `error:` line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "python -m " + _module_name(run)
    if "--help" in argv or "-h" in argv:
        print(tool_help(command, node, schema, doc))
        return None
    job, options = compose_tool(node, schema, argv, command)
    return run(job, options)


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


def tool_schema(node: str, schema: type) -> type:
    """The job schema with the tool's node added: one typed tree, so Hydra checks both alike."""
    tool_field = (node, schema, dataclasses.field(default_factory=schema))
    return dataclasses.make_dataclass(f"{schema.__name__}Job", [tool_field], bases=(JobConfig,))


def compose_tool(node: str, schema: type, argv: list[str], command: str = "") -> tuple[JobConfig, Any]:
    """(job config, tool options) from command-line overrides; ValueError naming the key and the fix."""
    own = {f.name for f in dataclasses.fields(schema)}
    overrides = []
    for arg in argv:
        if arg.startswith("-"):
            name = arg.lstrip("-")
            fix = f"write {node}.{name}=true" if name in own else f"see `{command} --help`"
            raise ValueError(f"{arg}: options are key=value overrides, not flags; {fix}.")
        key = arg.partition("=")[0]
        overrides.append(f"{node}.{arg}" if key in own else arg)
    full = tool_schema(node, schema)
    # Stored under the job's own name, so conf/config.yaml's defaults pick it up unchanged; every
    # composer registers its schema first (config.compose, main), so the job never sees this one.
    ConfigStore.instance().store(name="job_schema", node=full)
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = hcompose(config_name="config", overrides=overrides)
        obj = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(_explain(e, full, command)) from None
    job = JobConfig(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(JobConfig)})
    return job, getattr(obj, node)


def _explain(err: Exception, full: type, command: str) -> str:
    """Hydra's message (the one the job prints) plus the fix, found in the schema."""
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    lines = [ln for ln in str(err).splitlines() if not ln.startswith("To append to your config")]
    if cause is not err:
        internal = ("reference_type=", "object_type=")  # schema class names: noise to the user
        lines += [ln for ln in str(cause).splitlines() if not ln.strip().startswith(internal)]
    key = getattr(cause, "full_key", None) or ""
    parent_key, _, leaf = key.rpartition(".")
    parent = _node_type(full, parent_key)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and parent is not None:
        where = f"{parent_key}." if parent_key else ""
        names = ", ".join(where + n for n in _fields(parent))
        fix = f"'{key}' is not a setting; {parent_key or 'the config'} has {names}"
    elif isinstance(cause, ValidationError) and parent is not None and leaf in _fields(parent):
        kind, default = _type_name(typing.get_type_hints(parent)[leaf]), _default(_fields(parent)[leaf])
        fix = f"{key} takes a value of type {kind}, e.g. its default: {key}={default}"
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


def tool_help(command: str, node: str, schema: type, doc: str) -> str:
    hints, notes = typing.get_type_hints(schema), _comments(schema)
    rows = [(f"{node}.{f.name}={_default(f)}", _type_name(hints[f.name]), notes.get(f.name, ""))
            for f in dataclasses.fields(schema)]
    width = max(len(r[0]) for r in rows)
    kinds = max(len(r[1]) for r in rows)
    opts = "\n".join(f"  {a:<{width}}  {t:<{kinds}}  {n}".rstrip() for a, t, n in rows)
    return (f"usage: {command} [{node}.KEY=VALUE ...] [JOB OVERRIDES ...]\n\n"
            f"{(doc or '').strip()}\n\n"
            f"options ({node}.*, with their defaults; the `{node}.` prefix may be left off):\n{opts}\n\n"
            "job overrides: any key or group of the training job's config, in Hydra's grammar\n"
            "(experiment=NAME, target.path=..., data.seq_len=...); `python -m dflash_mp.main --help` lists\n"
            "them. A bad key or value fails before anything runs, naming the key and the fix.")
