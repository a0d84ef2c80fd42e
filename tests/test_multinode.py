"""Multi-node: two torchrun agents on loopback act as two nodes, through the real launch script."""

import glob
import os
import re
import socket
import subprocess
import sys

import pytest

from dflash_mp.topology import Topology
from dflash_mp.transport import TransportConfig, pair_kinds

from e2e_utils import SMALL, scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVLS_OFF = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_pair_locally_and_use_shm_within_each():
    topo = Topology.plan(2, 0, 4, ranks_per_node=2)
    assert topo.target_ranks == (0, 2) and topo.feeds == {0: (1,), 2: (3,)}
    assert set(pair_kinds(TransportConfig(kind="auto"), topo).values()) == {"shm"}
    # 1 target for 2 nodes: it cannot be node-local, so pairs cross nodes over p2p.
    topo = Topology.plan(1, 0, 4, ranks_per_node=2)
    assert set(pair_kinds(TransportConfig(kind="auto"), topo).values()) == {"shm", "p2p"}


@pytest.mark.parametrize("script", ["launch/slurm.sbatch", "launch/multi_node.sh", "launch/single_node.sh"])
def test_launch_scripts_parse_and_keep_nvlink_multicast_off(script):
    path = os.path.join(ROOT, script)
    subprocess.run(["bash", "-n", path], check=True)
    text = open(path).read()
    assert "launch/env.sh" in text or '"$(dirname "$0")/env.sh"' in text, script
    # What every script sources: NVLink multicast off unless the caller set the variable.
    env = {k: v for k, v in os.environ.items() if k not in NVLS_OFF}
    out = subprocess.run(["bash", "-c", f"source {os.path.join(ROOT, 'launch', 'env.sh')} && env"], env=env,
                         check=True, capture_output=True, text=True).stdout
    off = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert set(off) == set(NVLS_OFF)
    for var, value in off.items():
        assert f"\n{var}={value}\n" in f"\n{out}", (script, var)
    if script != "launch/single_node.sh":
        assert "--rdzv-backend c10d" in text and '"$@"' in text


@pytest.mark.slow
def test_two_node_run_on_loopback_trains_and_exports(tmp_path):
    run_dir = str(tmp_path / "run")
    overrides = SMALL + [f"run_dir={run_dir}", "topology.num_target_ranks=2", "train.max_steps=4",
                         "transport.kind=auto"]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "NNODES": "2", "NPROC": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RDZV_ID": f"test{port}", "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
    script = os.path.join(ROOT, "launch", "multi_node.sh")
    procs = [subprocess.Popen(["bash", script, *overrides], env={**env, "NODE_RANK": str(n)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    log = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), log[-6000:]
    topo_line = r"topology: world=4 targets=\[0, 2\] drafters=\[1, 3\] pairs: 0->\[1\], 2->\[3\]"
    assert re.search(topo_line, log), log[-4000:]
    assert "0->1 shm" in log and "2->3 shm" in log
    assert os.path.exists(f"{run_dir}/export/model.safetensors")
    assert sorted(row["step"] for row in scalars(run_dir)) == [1, 2, 3, 4]
    # Dashboards: the drafter registers the Custom Scalars layout, both roles show the resolved config.
    drafter_events = b"".join(open(f, "rb").read() for f in glob.glob(f"{run_dir}/tb/drafter/events.*"))
    target_events = b"".join(open(f, "rb").read() for f in glob.glob(f"{run_dir}/tb/target/events.*"))
    assert b"custom_scalars" in drafter_events and b"time/fwd_bwd_ms" in drafter_events
    assert b"drafter/acceptance_curve" in drafter_events and b"resolved/text_summary" in target_events
    assert b"config/text_summary" in target_events and b"num_target_ranks" in target_events
