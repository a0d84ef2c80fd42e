"""Backend choice when ranks own or share GPUs (device counts faked: no GPU needed)."""

import pytest
import torch

from dflash_mp.runtime import resolve_backend

CUDA = torch.device("cuda", 0)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_cpu_is_gloo_and_own_gpus_are_nccl(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu"), 3) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert resolve_backend("auto", CUDA, 8) == "nccl"


def test_two_ranks_on_one_gpu_use_gloo_and_the_ring(one_gpu):
    assert resolve_backend("auto", CUDA, 2) == "gloo"
    assert resolve_backend("auto", CUDA, 2, "shm") == "gloo"


def test_shared_gpu_refuses_nccl_and_p2p_with_the_fix(one_gpu):
    with pytest.raises(ValueError, match="topology.backend=auto"):
        resolve_backend("nccl", CUDA, 2)
    with pytest.raises(ValueError, match="transport.kind=auto or shm"):
        resolve_backend("auto", CUDA, 2, "p2p")
