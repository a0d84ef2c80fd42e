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
@torch.compile
def update(w, g):
    return w - 0.1 * g.sign()
step(torch.randn(32, 32), torch.randn(32, 32))
if mode == "save":
    compile_cache.save(path)  # as the drafter's leader after its first backward
update(torch.randn(32, 32), torch.randn(32, 32))
if mode == "save":
    compile_cache.save(path)  # and again after warm-up (the optimizer's graphs)
print(json.dumps(dict(counters["inductor"])))
"""


def compile_in_a_new_process(tmp_path, mode: str, path: str, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode, path], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_artifact_names_say_role_torch_device_and_code(tmp_path):
    path = compile_cache.artifact_path(str(tmp_path), "drafter", torch.device("cpu"))
    stamp = compile_cache.code_stamp()
    assert path == str(tmp_path / "compile_cache" / f"drafter-torch{torch.__version__}-cpu-{stamp}.bin")
    assert not compile_cache.load(path)  # nothing saved yet: compile as usual
    # Other code, another file: a source edited, added or renamed changes the stamp.
    code = tmp_path / "pkg"
    (code / "model").mkdir(parents=True)
    (code / "model" / "op.py").write_text("def f(): return 1\n")
    first = compile_cache.code_stamp(str(code))
    (code / "model" / "op.py").write_text("def f(): return 2\n")
    edited = compile_cache.code_stamp.__wrapped__(str(code))
    (code / "model" / "op.py").rename(code / "model" / "op2.py")
    renamed = compile_cache.code_stamp.__wrapped__(str(code))
    assert len({first, edited, renamed, stamp}) == 4 and all(len(s) == 10 for s in (first, edited, renamed))


@pytest.mark.slow
def test_a_fresh_process_loads_what_another_compiled_and_saved(tmp_path):
    """The file is saved twice, as the drafter's leader saves it: every graph of both saves is found
    (torch's own reader kept only the last save's: a resumed 8B drafter compiled 9 of its 11 FX
    graphs again)."""
    path = compile_cache.artifact_path(str(tmp_path / "run"), "drafter", torch.device("cpu"))
    first = compile_in_a_new_process(tmp_path, "save", path, "cache_a")
    assert first.get("fxgraph_cache_miss", 0) == 2 and os.path.getsize(path) > 0
    # A restart, or another node of the job: an empty Inductor cache, the run directory's artifacts.
    again = compile_in_a_new_process(tmp_path, "load", path, "cache_b")
    assert again.get("fxgraph_cache_hit", 0) == 2 and again.get("fxgraph_cache_miss", 0) == 0, again
    # Without the artifacts the same fresh start compiles.
    cold = compile_in_a_new_process(tmp_path, "none", path, "cache_c")
    assert cold.get("fxgraph_cache_miss", 0) == 2 and cold.get("fxgraph_cache_hit", 0) == 0, cold


def test_an_unreadable_artifact_file_means_compiling_not_failing(tmp_path):
    path = compile_cache.artifact_path(str(tmp_path), "target", torch.device("cpu"))
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"not a cache")
    assert compile_cache.load(path) is False


SHARED = r"""
import json, sys, time, datetime, torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from dflash_mp import compile_cache
rank, port, path, leader_compiles = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
shared = compile_cache.SharedCompile(path, store, "compile/drafter/node0", leader=rank == 0)
loaded = shared.before_compile()
t_ready = time.time()
@torch.compile
def step(x, w):
    return torch.relu(x @ w).square().sum(-1)
if rank == 1 or leader_compiles:
    step(torch.randn(32, 32), torch.randn(32, 32))
t_published = time.time()
shared.compiled()
print(json.dumps({"loaded": loaded, "ready": t_ready, "published": t_published, **counters["inductor"]}))
store.set("end", "1") if rank == 1 else store.wait(["end"])  # the store's server outlives its client
"""


def shared_compile(tmp_path, leader_compiles: bool) -> tuple[dict, dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = compile_cache.artifact_path(str(tmp_path / "run"), "drafter", torch.device("cpu"))
    procs = [subprocess.Popen([sys.executable, "-c", SHARED, str(r), str(port), path, str(int(leader_compiles))],
                              env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"cache{r}"),
                                   "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs[0], outs[1]


@pytest.mark.slow
def test_one_rank_of_a_node_compiles_and_the_other_loads_its_graphs(tmp_path):
    lead, follow = shared_compile(tmp_path, leader_compiles=True)
    assert lead.get("fxgraph_cache_miss", 0) >= 1
    assert follow["loaded"] and follow["ready"] >= lead["published"]  # it waited for the leader
    assert follow.get("fxgraph_cache_hit", 0) >= 1 and follow.get("fxgraph_cache_miss", 0) == 0, follow


@pytest.mark.slow
def test_a_leader_that_saved_nothing_releases_its_followers_to_compile(tmp_path):
    lead, follow = shared_compile(tmp_path, leader_compiles=False)
    assert not follow["loaded"] and follow.get("fxgraph_cache_miss", 0) >= 1


@pytest.mark.slow
def test_a_torchrun_job_compiles_the_drafter_once_per_node(tmp_path):
    """Two drafter ranks on one node, compiled on CPU: rank 1 compiles, rank 2 waits for its
    artifacts and loads them, and Python's log lines stay on the console during the compile."""
    from e2e_utils import SMALL, torchrun

    run_dir = tmp_path / "run"
    overrides = [o for o in SMALL if not o.startswith("train.compile")]
    proc = torchrun(3, overrides + ["train.compile=default", "train.max_steps=4", "topology.num_target_ranks=1",
                                    f"run_dir={run_dir}"], timeout=600)
    out = proc.stdout + proc.stderr
    lines = out.splitlines()
    saved = next(i for i, line in enumerate(lines) if "D1 INFO dflash_mp.compile_cache] compile cache: saved" in line)
    loaded = next(i for i, line in enumerate(lines) if "D2 INFO dflash_mp.compile_cache] compile cache: loaded" in line)
    assert saved < loaded
    assert "D2 INFO dflash_mp.compile_cache] compile cache: waited" in out
    assert "D1 INFO dflash_mp.compile_cache] compile cache: waited" not in out  # the leader compiles
    assert "0 recompiles after warm-up" in out
    native = run_dir / "logs" / "compile_rank_1.log"
    assert not native.exists() or "dflash_mp" not in native.read_text()
