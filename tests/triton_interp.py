"""Running Triton kernels on CPU, in Triton's interpreter, in a subprocess (TRITON_INTERPRET must be
set before the kernels are defined, so never in the test process itself).

The CPU build of torch comes without Triton: `make install` puts the triton package in
build/triton-interp for these runs alone, so the rest of the suite sees the CPU install a user has.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDE_PATH = ROOT / "build" / "triton-interp"
TESTS = Path(__file__).resolve().parent


def triton_path() -> str | None:
    """'' if triton imports here, the side install's directory if it has one, else None."""
    if importlib.util.find_spec("triton") is not None:
        return ""
    return str(SIDE_PATH) if (SIDE_PATH / "triton").is_dir() else None


HAS_TRITON = triton_path() is not None
SKIP_REASON = "no triton package (the CPU build of torch comes without it; `make install` adds build/triton-interp)"


def numpy2_index_shim() -> None:
    """Triton's interpreter holds scalars as 1-element arrays and takes `int()` of them where a loop
    bound needs an index, which numpy >= 2.4 refuses; read the element instead."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def run(module: str, call: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`from <module> import *; <call>` in a subprocess with the interpreter on (tests/ importable)."""
    path = triton_path()
    # A fresh Inductor cache: its key does not cover a custom op's fake implementation, so a graph
    # compiled against an older form of the kernels' contract would be reused.
    cache = tempfile.mkdtemp(prefix="inductor-")
    env = dict(os.environ, TRITON_INTERPRET="1", TORCHINDUCTOR_CACHE_DIR=cache)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, str(TESTS), env.get("PYTHONPATH", "")) if p)
    code = f"import triton_interp; triton_interp.numpy2_index_shim(); import {module} as m; m.{call}"
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
