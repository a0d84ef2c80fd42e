"""The `builtin:` names and the one cache root their built directories live under."""

from __future__ import annotations

import os

BUILTIN_DATA = "builtin:demo"
BUILTIN_TARGET = "builtin:tiny-qwen3"
# Same shapes as the tiny target, trained briefly on stdlib docstrings + the demo chats (learned.py),
# per size.
LEARNED_TARGETS = {"tiny": "builtin:learned-qwen3", "medium": "builtin:learned-qwen3-medium"}
# Random-weight targets -> the hub target whose shapes they copy (archs.TARGET_ARCHS, or the architecture
# itself for archs.HF_ARCHS / TINY_ARCHS: hybrid and MoE); None = TINY_QWEN3.
RANDOM_TARGETS = {"builtin:random-qwen3-8b": "Qwen/Qwen3-8B", "builtin:random-tiny-qwen3": None,
                  "builtin:random-qwen3.5-27b": "Qwen/Qwen3.5-27B",
                  "builtin:random-qwen3.5-35b-a3b": "Qwen/Qwen3.5-35B-A3B",
                  "builtin:random-qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
                  "builtin:random-tiny-qwen3.5": "tiny-qwen3.5"}
BUILTIN_TARGETS = (BUILTIN_TARGET, *LEARNED_TARGETS.values(), *RANDOM_TARGETS)
# Bump when the tokenizer, the target or the data change, so stale caches are not reused.
DEMO_VERSION = 1


def cache_root(cache_dir: str = "") -> str:
    """Where builtin targets are built: `target.cache_dir` when set, else $DFLASH_MP_CACHE, else
    ~/.cache/dflash_mp (the environment variable is the default of the setting, not a second root)."""
    root = cache_dir or os.environ.get("DFLASH_MP_CACHE") or os.path.join("~", ".cache", "dflash_mp")
    return os.path.expanduser(root)
