"""Summarise the production runs of bench/run_multigpu.sh: one row per run directory under WORK.

    python bench/splits.py WORK [--skip 20]

samples/s is the drafters' rate over the logged intervals after `--skip` steps (compile and warm-up
excluded); the physical limit is GPUs x 790 TFLOP/s over the FLOPs of one row through both roles
(Qwen3-8B target forward 41.7 TFLOP + drafter step 70.1 TFLOP at 3072 tokens, BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json  # noqa: E402
from pipeline import interval_rate, rows  # noqa: E402

ROW_TFLOP = 41.7 + 70.1
PEAK = 790.0


def gpus_of(name: str) -> int:
    return 1 if "1gpu" in name else int(os.environ.get("BENCH_GPUS", "2"))


def mean(rs: list[dict], key: str):
    vals = [r[key] for r in rs if key in r]
    return sum(vals) / len(vals) if vals else None


def summarise(run_dir: str, name: str, skip: int, rc: dict) -> dict:
    out = {"name": name, "rc": rc.get("rc"), "wall_s": rc.get("wall_s")}
    try:
        d = rows(f"{run_dir}/tb/drafter/scalars.jsonl")
        t = rows(f"{run_dir}/tb/target/scalars.jsonl")
    except OSError:
        return out
    rate, steps = interval_rate(d, skip)
    late, late_t = [r for r in d if r["step"] > skip], [r for r in t if r["step"] > skip]
    g = gpus_of(name)
    limit = g * PEAK / ROW_TFLOP
    out.update({
        "gpus": g, "samples_per_s": rate, "steps_measured": steps,
        "context_tokens_per_s": mean(late, "throughput/tokens_per_s"),
        "drafter_mfu": mean(late, "throughput/mfu"), "target_mfu": mean(late_t, "target/mfu"),
        "wait_ms": mean(late, "comm/wait_ms"), "stall_ms": mean(late_t, "comm/stall_ms"),
        "allreduce_ms": mean(late, "time/allreduce_ms"), "fwd_bwd_ms": mean(late, "time/fwd_bwd_ms"),
        "startup_s_drafter": mean(d, "time/startup_s"), "startup_s_target": mean(t, "time/startup_s"),
        "physical_limit_samples_per_s": limit, "fraction_of_limit": rate / limit,
        "recompiles": max((r.get("compile/recompiles", 0) for r in d), default=None),
    })
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--skip", type=int, default=20)
    a = ap.parse_args()
    rcs = {}
    if os.path.exists(f"{a.work}/rc.jsonl"):
        with open(f"{a.work}/rc.jsonl") as f:
            for line in f:
                r = json.loads(line)
                rcs[r["name"]] = r
    res = [summarise(os.path.join(a.work, n), n, a.skip, rcs.get(n, {}))
           for n in sorted(os.listdir(a.work)) if os.path.isdir(os.path.join(a.work, n, "tb"))]
    write_json({"runs": res}, "splits.json")

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    print(f"{'run':16} {'rc':>3} {'GPUs':>4} {'samp/s':>7} {'ctx tok/s':>9} {'T MFU':>6} {'D MFU':>6} "
          f"{'wait':>6} {'stall':>6} {'allred':>6} {'start D':>7} {'limit':>6}")
    for r in res:
        print(f"{r['name']:16} {f(r.get('rc'), 'd'):>3} {f(r.get('gpus'), 'd'):>4} {f(r.get('samples_per_s'), '.2f'):>7} "
              f"{f(r.get('context_tokens_per_s'), '.0f'):>9} {f(r.get('target_mfu'), '.3f'):>6} "
              f"{f(r.get('drafter_mfu'), '.3f'):>6} {f(r.get('wait_ms'), '.1f'):>6} {f(r.get('stall_ms'), '.1f'):>6} "
              f"{f(r.get('allreduce_ms'), '.1f'):>6} {f(r.get('startup_s_drafter'), '.0f'):>7} "
              f"{f(r.get('fraction_of_limit'), '.3f'):>6}")


if __name__ == "__main__":
    main()
