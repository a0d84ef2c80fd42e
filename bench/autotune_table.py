"""The table of run_autotune_h200.sh: per part (contended / clean compile), the timed runs and the GPU
time of the Inductor kernels (pointwise and reductions) against the cuBLAS matmuls.

    python bench/autotune_table.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys


def inductor_ms(profile: dict) -> float:
    """GPU ms per call in Inductor's Triton kernels (their names start with triton_)."""
    return sum(k["ms"] for k in profile.get("top_kernels", []) if k["name"].startswith("triton_"))


def rows(out: str):
    for how in ("contended", "clean"):
        for name, key, label in (("target_qwen3_8b.json", "variants", "variant"),
                                 ("drafter_qwen3_8b_layers.json", "modes", "mode")):
            path = os.path.join(out, how, name)
            if not os.path.exists(path):
                continue
            with open(path) as f:
                for r in json.load(f)[key]:
                    p = r.get("profile") or {}
                    ms = r.get("ms", r.get("ms_per_step"))
                    cls = p.get("ms_per_step_by_class", {})
                    yield (name.split("_")[0], how, r.get(label), ms, cls.get("matmul"), inductor_ms(p))


def main() -> None:
    out = sys.argv[1]
    print(f"{'role':8} {'compile':10} {'variant':32} {'ms':>8} {'matmul ms':>10} {'inductor ms (top kernels)':>26}")
    for role, how, v, ms, mm, ind in rows(out):
        f = lambda x: f"{x:.2f}" if isinstance(x, (int, float)) else "-"  # noqa: E731
        print(f"{role:8} {how:10} {str(v):32} {f(ms):>8} {f(mm):>10} {f(ind):>26}")


if __name__ == "__main__":
    main()
