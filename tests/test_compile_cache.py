"""Compiled once, reused: what one process compiled and saved under the run directory, another
process with an empty Inductor cache (another rank, a restart, another node) looks up instead of
compiling."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dflash_mp import compile_cache

SCRIPT = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from dflash_mp import compile_cache
mode, path = sys.argv[1], sys.argv[2]
if mode == "load":
    compile_cache.load(path)
@torch.compile
def step(x, w):
    return torch.relu(x @ w).square().sum(-1)
step(torch.randn(32, 32), torch.randn(32, 32))
if mode == "save":
    compile_cache.save(path)
print(json.dumps(dict(counters["inductor"])))
"""


def compile_in_a_new_process(tmp_path, mode: str, path: str, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode, path], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_artifact_names_say_role_torch_and_device(tmp_path):
    path = compile_cache.artifact_path(str(tmp_path), "drafter", torch.device("cpu"))
    assert path == str(tmp_path / "compile_cache" / f"drafter-torch{torch.__version__}-cpu.bin")
    assert not compile_cache.load(path)  # nothing saved yet: compile as usual


@pytest.mark.slow
def test_a_fresh_process_loads_what_another_compiled_and_saved(tmp_path):
    path = compile_cache.artifact_path(str(tmp_path / "run"), "drafter", torch.device("cpu"))
    first = compile_in_a_new_process(tmp_path, "save", path, "cache_a")
    assert first.get("fxgraph_cache_miss", 0) >= 1 and os.path.getsize(path) > 0
    # A restart, or another node of the job: an empty Inductor cache, the run directory's artifacts.
    again = compile_in_a_new_process(tmp_path, "load", path, "cache_b")
    assert again.get("fxgraph_cache_hit", 0) >= 1 and again.get("fxgraph_cache_miss", 0) == 0, again
    # Without the artifacts the same fresh start compiles.
    cold = compile_in_a_new_process(tmp_path, "none", path, "cache_c")
    assert cold.get("fxgraph_cache_miss", 0) >= 1 and cold.get("fxgraph_cache_hit", 0) == 0, cold


def test_an_unreadable_artifact_file_means_compiling_not_failing(tmp_path):
    path = compile_cache.artifact_path(str(tmp_path), "target", torch.device("cpu"))
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"not a cache")
    assert compile_cache.load(path) is False
