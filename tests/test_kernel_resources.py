"""The project's Triton kernels compile for the H200 (sm_90) and the A100 (sm_80) as the ops launch
them, on this CPU (bench/kernel_resources.py: Triton's compiler and ptxas, no GPU), and fit them: the
interpreter tests check the kernels' arithmetic, not that the GPU compiler takes them or that their
tiles fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import triton_interp

ROOT = triton_interp.ROOT
pytestmark = pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """(the tool's JSON, its table) for the compute capability `request.param` x 10."""
    out = tmp_path_factory.mktemp("kernels") / "resources.json"
    path = os.pathsep.join(p for p in (triton_interp.triton_path(), str(ROOT / "src")) if p)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_resources.py"), "--json", str(out),
                          "--arch", str(request.param)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text()), run.stdout


BOTH = pytest.mark.parametrize("compiled", [90, 80], ids=["h200", "a100"], indirect=True)


@BOTH
def test_every_kernel_compiles_at_every_preset_shape(compiled):
    got, table = compiled
    launched = {(r["case"], r["kernel"]) for r in got["rows"]}
    drafter = ("block_attn_fwd", "block_attn_bwd_dq", "block_attn_bwd_dkv")
    drafters = ("qwen3_8b", "qwen3_5_27b_sliding", "llama3_3_70b", "head_dim_64", "head_dim_64_g8")
    want = {(f"drafter {name}{how}", k) for name in drafters for how in ("", " pointers") for k in drafter}
    targets = ("qwen3_8b", "llama3_3_70b", "qwen3_235b_a22b", "qwen3_5_27b", "head_dim_64")
    want |= {(f"target {name}{how}", "doc_attn_fwd") for name in targets for how in ("", " pointers")}
    want |= {(f"loss {name}", k) for name in ("qwen", "llama") for k in ("stats_lanes_kernel", "grad_kernel")}
    if got["arch"] >= 90:  # the fused SwiGLU GEMMs load through tensor descriptors only
        want |= {("target swiglu", "swiglu_gemm"), ("target swiglu gu", "swiglu_gemm"),
                 ("swiglu backward", "swiglu_bwd_gemm")}
    assert launched == want, table
    # The ops' own choices reached the compiler: two blocks a program where G*B allows it, TMA on request.
    meta = {(r["case"], r["kernel"]): r["meta"] for r in got["rows"]}
    assert meta[("drafter qwen3_8b", "block_attn_fwd")]["NB"] == 2
    assert meta[("drafter llama3_3_70b", "block_attn_fwd")]["NB"] == 1
    assert meta[("drafter qwen3_8b", "block_attn_bwd_dq")]["TMA"] is True
    assert meta[("drafter qwen3_8b pointers", "block_attn_bwd_dq")]["TMA"] is False


@BOTH
def test_every_kernel_fits_the_gpus_shared_memory_at_its_measured_stages(compiled):
    """On the H200 every path; on the A100, which has no TMA, the pointer paths it runs."""
    got, table = compiled
    runs = [r for r in got["rows"] if got["arch"] >= 90 or r["meta"].get("TMA") is not True]
    over = [(r["case"], r["kernel"], r["shared"]) for r in runs if r["shared"] > got["shared_limit"]]
    why = "a launch would drop a stage, slower than measured"
    assert not over, f"over {got['shared_limit']} bytes ({why}):\n{table}"


@pytest.mark.parametrize("compiled", [90], ids=["h200"], indirect=True)
def test_no_kernel_spills_registers_on_the_h200_but_the_drafters_dkv(compiled):
    """The dK/dV kernel's 128 x 128 tiles of four matmuls use every register and spill (BENCHMARKS.md,
    issue 31); every other kernel keeps its state in registers on the H200 the tiles were measured on."""
    got, table = compiled
    spills = [(r["case"], r["kernel"], r["stack"]) for r in got["rows"]
              if (r["stack"] or r["local"]) and r["kernel"] != "block_attn_bwd_dkv"]
    assert not spills, table


@pytest.mark.parametrize("compiled", [80, 120], ids=["a100", "sm120"], indirect=True)
def test_the_shared_memory_bounds_in_the_code_cover_what_the_kernels_ask_for(compiled):
    """block_attn.SHARED_BYTES and doc_attn.SHARED_BYTES keep `auto` off the kernels on GPUs they do not
    fit. Below the H200 (sm_80, and sm_120 with 99 KiB) a kernel asked for the same at 3 and at 1 stages
    (checked by hand, not here), so these figures are what such a GPU is asked for: each bound covers
    them, and it rules out a 99 KiB GPU exactly when they exceed it."""
    from dflash_mp.model import block_attn
    from dflash_mp.target import doc_attn

    got, table = compiled
    small = 99 * 1024
    rows = [r for r in got["rows"] if got["arch"] >= 90 or r["meta"].get("TMA") is not True]  # as they run
    for d, bound in block_attn.SHARED_BYTES.items():
        need = max(r["shared"] for r in rows if r["kernel"].startswith("block_attn") and r["meta"]["D"] == d)
        assert need <= bound and (need > small) == (bound > small), (d, need, bound)
    for d, bound in doc_attn.SHARED_BYTES.items():
        need = max(r["shared"] for r in rows if r["kernel"] == "doc_attn_fwd" and r["meta"]["D"] == d)
        assert need <= bound and (need > small) == (bound > small), (d, need, bound)


@pytest.mark.parametrize("compiled", [90], ids=["h200"], indirect=True)
def test_the_fused_swiglus_shared_memory_bound_covers_what_it_asks_for(compiled):
    """swiglu.SHARED_BYTES keeps the fused SwiGLU GEMMs (the target's, the training form's forward and
    backward) off GPUs whose blocks have less (they fall back to the model's own MLP there,
    swiglu.fused_runs)."""
    from dflash_mp import swiglu

    got, table = compiled
    need = max(r["shared"] for r in got["rows"] if r["kernel"] in ("swiglu_gemm", "swiglu_bwd_gemm"))
    assert need <= swiglu.SHARED_BYTES <= got["shared_limit"], (need, table)
