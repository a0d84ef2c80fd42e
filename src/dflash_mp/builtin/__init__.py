"""Everything a `builtin:` name stands for, and the one place such names are read.

The demo chats (`builtin:demo`), the local tokenizer, and targets built from configs: tiny
(`builtin:tiny-qwen3`), random-weight with real shapes (`builtin:random-*`) and small learned ones
(`builtin:learned-qwen3*`). `resolve(job)` turns every such name of a job into a real path, once, at
the edge: the modules below (target, data, config, plan) only ever see real paths.
"""

from __future__ import annotations

import dataclasses
import os

from ..archs import HF_ARCHS, TINY_ARCHS, known_target_config
from .chats import demo_data_path, demo_texts
from .learned import learned_target_dir
from .names import (BUILTIN_DATA, BUILTIN_TARGET, BUILTIN_TARGETS, DEMO_VERSION, LEARNED_TARGETS, RANDOM_TARGETS,
                    cache_root)
from .targets import (TINY_QWEN3, build_demo_target, build_demo_tokenizer, build_random_arch_target, build_random_target,
                      demo_qwen3_config)

__all__ = [
    "BUILTIN_DATA", "BUILTIN_TARGET", "BUILTIN_TARGETS", "LEARNED_TARGETS", "RANDOM_TARGETS", "TINY_QWEN3",
    "build_demo_target", "build_demo_tokenizer", "build_random_target", "cache_root", "demo_data_path",
    "demo_qwen3_config", "demo_texts", "resolve", "resolve_data_path", "resolve_target_path",
]


def resolve_target_path(path: str, cache_dir: str = "") -> str:
    """The local directory of a builtin target, built once under the cache root; other values pass
    through.

    Safe when several ranks race: each builds privately and renames; a complete directory is never
    visible half-written, so "config.json exists" means "ready". Learned targets are never trained
    here (minutes of training hidden in a start-up): they must have been built.
    """
    if not path.startswith("builtin:"):
        return path
    if path not in BUILTIN_TARGETS:
        raise ValueError(f"target.path={path!r} is not a builtin target; the builtins are "
                         f"{', '.join(BUILTIN_TARGETS)}")
    for size, name in LEARNED_TARGETS.items():
        if path == name:
            out = learned_target_dir(cache_dir, size)
            if not os.path.isfile(os.path.join(out, "config.json")):
                raise ValueError(f"target.path={path}: the learned target is not built under {cache_root(cache_dir)}; "
                                 f"build it first: python -m dflash_mp.builtin build-learned build_learned.size={size}"
                                 + (f" build_learned.cache_dir={cache_dir}" if cache_dir else ""))
            return out
    out = os.path.join(cache_root(cache_dir), f"{path.removeprefix('builtin:')}-v{DEMO_VERSION}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tokenizer = build_demo_tokenizer(demo_texts())
    if path == BUILTIN_TARGET:
        return build_demo_target(out, tokenizer)
    hub_id = RANDOM_TARGETS[path]
    if hub_id in HF_ARCHS or hub_id in TINY_ARCHS:
        return build_random_arch_target(out, tokenizer, HF_ARCHS.get(hub_id) or TINY_ARCHS[hub_id])
    return build_random_target(out, tokenizer, **(known_target_config(hub_id) if hub_id else {}))


def resolve_data_path(path: str) -> str:
    """The shipped demo chats' file for `builtin:demo`; other values pass through."""
    if path == BUILTIN_DATA:
        return demo_data_path()
    if path.startswith("builtin:"):
        raise ValueError(f"data.path={path!r} is not a builtin data set; the one builtin is {BUILTIN_DATA}")
    return path


def resolve(job):
    """`job` with its builtin target and data names replaced by real paths (building what needs it)."""
    target = dataclasses.replace(job.target, path=resolve_target_path(job.target.path, job.target.cache_dir))
    data = dataclasses.replace(job.data, path=resolve_data_path(job.data.path))
    return dataclasses.replace(job, target=target, data=data)
