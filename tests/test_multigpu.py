"""Group creation and the transport at start-up, through the entry point's own `init_distributed`:
every layout of ranks over GPUs gets its groups, communicators and first batches in seconds. The
launch once hung here for minutes on 2 GPUs (an eagerly bound NCCL default group split against gloo
group creation); these runs time out in 90 s instead."""

import ast
import os
import re
import subprocess
import sys

import pytest
import torch

JOB = os.path.join(os.path.dirname(__file__), "multigpu_job.py")
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launch(nproc: int, num_targets: int, kind: str, timeout: float = 90, cpu: bool = False) -> dict[int, dict]:
    env = {**os.environ, **NCCL_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           JOB, str(num_targets), kind]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"start-up hung for {timeout} s:\n{(e.stdout or b'')[-3000:]}\n{(e.stderr or b'')[-5000:]}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    # Ranks print concurrently into one pipe: lines can run into each other.
    out = {int(r): ast.literal_eval(b) for r, b in re.findall(r"ok (\d+) (\{[^}]*\})", p.stdout)}
    assert sorted(out) == list(range(nproc)), p.stdout
    return out


def test_every_group_and_pair_group_starts_on_cpu_with_gloo():
    got = launch(3, 1, "p2p", cpu=True)
    assert got[0] == {"targets": "gloo", "drafters": "gloo", "control": "gloo", "drafters_cpu": "gloo",
                      "pair 0->1": "gloo", "pair 0->2": "gloo"}


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("kind", ["p2p", "shm"])
def test_one_target_one_drafter_on_two_gpus_starts_in_seconds(kind):
    got = launch(2, 1, kind)
    want = {"targets": "nccl", "drafters": "nccl", "control": "gloo", "drafters_cpu": "gloo"}
    if kind == "p2p":
        want["pair 0->1"] = "nccl"
    assert got[0] == want


@pytest.mark.gpu
@two_gpus
def test_shared_gpus_keep_nccl_for_groups_whose_members_own_distinct_gpus():
    # 4 ranks on 2 GPUs: targets 0, 1 and drafters 2, 3; pairs 0->2 and 1->3 share a GPU (shm ring),
    # but each role's group spans both GPUs: NCCL there, not gloo.
    got = launch(4, 2, "auto")
    assert got[2]["drafters"] == "nccl" and got[0]["targets"] == "nccl"
    assert not any(k.startswith("pair") for k in got[2])


@pytest.mark.gpu
@two_gpus
def test_a_drafter_group_with_two_members_on_one_gpu_falls_back_to_gloo():
    got = launch(4, 1, "auto")  # drafters 1, 2, 3 on GPUs 1, 0, 1
    assert got[1]["drafters"] == "gloo" and got[1]["targets"] == "nccl"
