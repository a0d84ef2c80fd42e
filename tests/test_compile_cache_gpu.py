"""A restart (or another node) compiles nothing the run has compiled before: a drafter step with the
job's GPU defaults (flex attention in layers scope, the Triton CE, the compiled BlockMask builder)
runs in one process from empty caches and saves its artifacts; a second process with new empty
Inductor and Triton caches loads them and finds every FX graph and AOTAutograd entry: no miss, no
bypass."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[3])
from torch._dynamo.utils import counters
from common import synthetic_batch
from dflash_mp import compile_cache
from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.trainer import DFlashObjective, DrafterConfig, DrafterTrainer, TrainConfig
mode, path = sys.argv[1], sys.argv[2]
loaded = compile_cache.load(path) if mode == "load" else False
dev = torch.device("cuda")
args = DrafterArgs(hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                   vocab_size=2048, target_layer_ids=[1, 2, 3], block_size=16, mask_token_id=2047,
                   layer_types=["sliding_attention", "full_attention"], sliding_window=512)
torch.manual_seed(0)
with torch.device(dev):
    d = DFlashDrafter(args)
g = torch.Generator(dev).manual_seed(1)
embed = (torch.randn(2048, 512, generator=g, device=dev) * 0.02).bfloat16()
head = (torch.randn(2048, 512, generator=g, device=dev) * 0.02).bfloat16()
obj = DFlashObjective(d, args, embed, head, DrafterConfig(num_layers=2, block_size=16, num_anchors=64,
                      max_anchors_per_doc=64, loss_chunk_size=512, layer_types=args.layer_types, sliding_window=512))
tr = DrafterTrainer(obj, TrainConfig(warmup_ratio=0.0), 100, None, dev)  # the job's defaults
hb = synthetic_batch(1024, 3 * 512, 2048, dev, torch.bfloat16, seed=0, lo=64, hi=400)
t = time.perf_counter()
for _ in range(2):
    tr.train_step(hb)
tr.opt.wait_all()
torch.cuda.synchronize()
first_s = time.perf_counter() - t
saved = compile_cache.save(path) if mode == "save" else False
got = {**counters["inductor"], **counters["aot_autograd"]}
print(json.dumps({"loaded": loaded, "saved": saved, "s": first_s, "mode": tr.mode, "loss_kernel": tr.loss_kernel,
                  **{k: int(v) for k, v in got.items() if "cache" in k}}))
"""


def run(tmp_path, mode: str, path: str, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache / "inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / cache / "triton"), "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode, path, str(ROOT / "bench")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_restart_into_empty_caches_finds_every_drafter_graph_in_the_saved_artifacts(tmp_path):
    path = str(tmp_path / "run" / "compile_cache" / "drafter.bin")
    cold = run(tmp_path, "save", path, "cold")
    assert cold["mode"] == "default" and cold["loss_kernel"] == "triton" and cold["saved"]
    assert cold.get("fxgraph_cache_miss", 0) >= 4 and cold.get("autograd_cache_saved", 0) >= 2, cold
    again = run(tmp_path, "load", path, "restart")
    print(f"\nfirst two steps: cold {cold['s']:.1f} s, from the artifacts {again['s']:.1f} s; restart counters {again}")
    assert again["loaded"]
    assert again.get("fxgraph_cache_miss", 0) == 0 and again.get("autograd_cache_miss", 0) == 0, again
    assert again.get("fxgraph_cache_bypass", 0) == 0 and again.get("autograd_cache_bypass", 0) == 0, again
    assert again.get("fxgraph_cache_hit", 0) == cold["fxgraph_cache_miss"], (cold, again)
    assert again.get("autograd_cache_hit", 0) == cold["autograd_cache_saved"], (cold, again)
