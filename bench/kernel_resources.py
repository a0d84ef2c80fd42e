"""The project's Triton kernels compiled for a GPU on a machine without one: each kernel as the ops
launch it at the presets' shapes (the same specialization, tiles, warps and stages), compiled for
sm_90 (H100/H200; `--arch 80`: the A100) by Triton's own compiler and ptxas, and its resources read
from the cubin:

    python bench/kernel_resources.py                  # the table
    python bench/kernel_resources.py --json out.json  # also as JSON (tests/test_kernel_resources.py)
    python bench/kernel_resources.py --ptx DIR        # each kernel's PTX, debug lines stripped

Shared memory is what a launch asks for (a kernel over the GPU's limit, 227 KiB a block on sm_90
and 163 KiB on sm_80, fails to launch and triton_launch.launch retries it with a stage fewer);
registers and stack (spilled registers) are ptxas's. `--ptx` of two commits, diffed, shows whether a
change to a kernel's source changed its code. Needs the triton package (on a CPU machine: `make
install` puts it in build/triton-interp; run with PYTHONPATH=build/triton-interp:src). Nothing runs
on a GPU: the ops are called on CPU tensors and each launch only compiles. Speed is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

# Bytes of shared memory a block may use: sm_90 (H100/H200) 227 KiB, sm_80 (A100) 163 KiB, sm_120 99 KiB.
SHARED_LIMIT = {90: 232448, 80: 166912, 120: 101376}

# Drafter attention shapes of the presets: (name, query heads, KV heads, head_dim, block size, window).
DRAFTERS = [
    ("qwen3_8b", 32, 8, 128, 16, None),  # also qwen3_4b and llama3_1_8b_instruct
    ("qwen3_5_27b_sliding", 32, 8, 128, 16, 2048),
    ("llama3_3_70b", 64, 8, 128, 16, None),  # 8 query heads a KV head: one block a program
    ("head_dim_64", 32, 8, 64, 16, None),  # a drafter of a head_dim-64 target
    ("head_dim_64_g8", 64, 8, 64, 16, None),
]
# Target attention shapes: (name, query heads, KV heads, head_dim).
TARGETS = [
    ("qwen3_8b", 32, 8, 128),  # also qwen3_4b and llama3_1_8b_instruct
    ("llama3_3_70b", 64, 8, 128),
    ("qwen3_235b_a22b", 64, 4, 128),
    ("qwen3_5_27b", 24, 4, 256),
    ("head_dim_64", 16, 8, 64),
]
VOCABS = [("qwen", 151936), ("llama", 128256)]


class _CompileOnly:
    """Enough of a Triton driver to specialize and compile kernels for `arch` without a GPU."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


def _resources(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    got = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", out))
    return {"registers": int(got["REG"]), "stack": int(got["STACK"]), "local": int(got["LOCAL"])}


def stripped_ptx(ptx: str) -> str:
    """The PTX's code: debug sections, line records and comments dropped (they move with the source)."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    return "\n".join(x for x in code.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp)", x))


def compile_all(arch: int = 90) -> list[dict]:
    """Every case's kernels, compiled as the ops launch them: one row per launch."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    rows: list[dict] = []
    case = {"name": ""}
    caches: dict = {}  # kernel -> its per-device caches before this run (they hold the target compiled for)

    def compile_launch(self, grid):
        def run(*args, **kwargs):
            if self not in caches:
                caches[self] = dict(self.device_caches)
                self.device_caches.clear()
            kernel = self.warmup(*args, grid=grid, **kwargs)
            meta = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, str))}
            rows.append({"case": case["name"], "kernel": self.fn.__name__, "meta": meta,
                         "shared": kernel.metadata.shared, **_resources(kernel.asm["cubin"]),
                         "ptx": stripped_ptx(kernel.asm["ptx"])})
        return run

    saved, active = JITFunction.__getitem__, driver._active  # None until a kernel first asks for it
    driver.set_active(_CompileOnly(arch))
    JITFunction.__getitem__ = compile_launch
    try:
        for name, fn in _cases(arch):
            case["name"] = name
            fn()
    finally:
        JITFunction.__getitem__ = saved
        driver._active = active
        for kernel, cache in caches.items():  # nothing compiled here for `arch` is launched later
            kernel.device_caches.clear()
            kernel.device_caches.update(cache)
    return rows


def _cases(arch: int):
    from dflash_mp.model import block_attn
    from dflash_mp.target import doc_attn

    for name, hq, hkv, d, b, window in DRAFTERS:
        for tma in (True, False):
            yield (f"drafter {name}{'' if tma else ' pointers'}",
                   lambda hq=hq, hkv=hkv, d=d, b=b, window=window, tma=tma:
                   _with_tma(block_attn, tma, lambda: _drafter_attention(hq, hkv, d, b, window)))
    for name, hq, hkv, d in TARGETS:
        for tma in (True, False):
            yield (f"target {name}{'' if tma else ' pointers'}",
                   lambda hq=hq, hkv=hkv, d=d, tma=tma:
                   _with_tma(doc_attn, tma, lambda: _target_attention(hq, hkv, d)))
    for name, vocab in VOCABS:
        yield f"loss {name}", lambda vocab=vocab: _loss(vocab)
    if arch >= 90:  # tensor descriptors only: it runs on GPUs with TMA (swiglu.fused_runs)
        yield "target swiglu", _swiglu
        yield "target swiglu gu", lambda: _swiglu(gate_up=True)
        yield "swiglu backward", _swiglu_backward


def _with_tma(module, tma: bool, fn) -> None:
    """`fn()` with `module.USE_TMA` forced to `tma`, then as it was."""
    before, module.USE_TMA = module.USE_TMA, tma
    try:
        fn()
    finally:
        module.USE_TMA = before


def _drafter_attention(hq: int, hkv: int, d: int, b: int, window: int | None) -> None:
    """The drafter's block attention, forward and backward, on one small row (the kernels' compile-time
    constants do not depend on the row's length)."""
    from dflash_mp.model.anchors import sample_anchors
    from dflash_mp.model.block_attn import block_attention, block_spans

    T, A = 256, 8
    docs = torch.cat([torch.zeros(100, dtype=torch.long), torch.ones(T - 100, dtype=torch.long)])
    anchors, valid = sample_anchors(torch.ones(T, dtype=torch.long), docs, A, None, noise=torch.rand(2, T))
    q, k, v = (torch.randn(n, h, d, dtype=torch.bfloat16, requires_grad=True)
               for n, h in ((A * b, hq), (T + A * b, hkv), (T + A * b, hkv)))
    block_attention(q, k, v, block_spans(anchors, valid, docs, b, window)).sum().backward()


def _target_attention(hq: int, hkv: int, d: int) -> None:
    from dflash_mp.target.doc_attn import doc_attention, doc_rows

    T = 256
    q, k, v = (torch.randn(T, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    doc_attention(q, k, v, doc_rows(torch.cat([torch.zeros(100), torch.ones(T - 100)]).long(), d))


def _swiglu(gate_up: bool = False) -> None:
    """The target's gate/up GEMM with its SwiGLU epilogue, at its default tiles (the sizes are runtime
    arguments: any will do); `gate_up`: the form that also writes both projections (swiglu_gu_op)."""
    from dflash_mp.swiglu import TILES, swiglu_gu_op, swiglu_op

    x, w = torch.randn(256, 512, dtype=torch.bfloat16), torch.randn(512, 512, dtype=torch.bfloat16)
    (swiglu_gu_op if gate_up else swiglu_op)(x, w, w, list(TILES))


def _swiglu_backward() -> None:
    """The training MLP's backward GEMM (dh = dy wd, the SwiGLU's gradient as its epilogue) at its
    default tiles (swiglu.TILES_BWD)."""
    from dflash_mp.swiglu import TILES_BWD, swiglu_bwd_op

    dy, wd = torch.randn(256, 512, dtype=torch.bfloat16), torch.randn(512, 512, dtype=torch.bfloat16)
    g = torch.randn(256, 512, dtype=torch.bfloat16)
    swiglu_bwd_op(dy, wd, g, g, list(TILES_BWD))


def _loss(vocab: int) -> None:
    from dflash_mp.model.ce_kernels import ce_stats, softmax_grad_

    logits = torch.randn(4, vocab, dtype=torch.bfloat16)
    labels = torch.zeros(4, dtype=torch.long)
    _, _, lse = ce_stats(logits, labels)
    softmax_grad_(logits, labels, lse)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90,
                    help="compute capability x 10 (90: H100/H200; 80: A100, whose kernels load through "
                         "pointers)")
    ap.add_argument("--json", help="write the rows (without PTX) here")
    ap.add_argument("--ptx", help="write each kernel's stripped PTX into this directory")
    a = ap.parse_args()
    rows = compile_all(a.arch)
    if a.ptx:
        os.makedirs(a.ptx, exist_ok=True)
        for r in rows:
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{r['case']}_{r['kernel']}")
            with open(os.path.join(a.ptx, name + ".ptx"), "w") as f:
                f.write(r["ptx"])
    for r in rows:
        r.pop("ptx")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"arch": a.arch, "shared_limit": SHARED_LIMIT.get(a.arch), "rows": rows}, f, indent=1)
    print(f"{'case':36} {'kernel':20} {'warps':>5} {'stages':>6} {'shared B':>9} {'regs':>4} {'stack':>5}")
    for r in rows:
        m = r["meta"]
        print(f"{r['case']:36} {r['kernel']:20} {m.get('num_warps', 4):5} {m.get('num_stages', '-'):>6} "
              f"{r['shared']:9} {r['registers']:4} {r['stack']:5}")


if __name__ == "__main__":
    sys.exit(main())
