"""Launch the real entry point under torchrun and read back what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Small enough for 2 CPU cores, large enough that every piece (shards, packing, anchors, DDP) is real.
SMALL = [
    "data.max_rows=160",
    "data.seq_len=256",
    "drafter.num_anchors=32",
    "drafter.max_anchors_per_doc=8",
    "drafter.loss_chunk_size=64",
    "logging.log_every=1",
    "logging.progress=false",
    "train.compile=eager",
]


def torchrun(nproc: int, overrides: list[str], timeout: float = 300, extra_args: list[str] | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    # CUDA_VISIBLE_DEVICES empty: these jobs run on the CPU on any host, as the CPU references they are
    # checked against do (on a GPU host their ranks would otherwise take the GPU and compute in bf16).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *(extra_args or []), "-m", "dflash_mp.main", *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def scalars(run_dir: str, role: str = "drafter") -> list[dict]:
    with open(os.path.join(run_dir, "tb", role, "scalars.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(run_dir: str) -> dict[int, float]:
    return {row["step"]: row["drafter/loss"] for row in scalars(run_dir)}
