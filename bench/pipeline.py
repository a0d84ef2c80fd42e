"""Pipeline efficiency of a 1+1 run on one GPU (target and drafter ranks share it through the shm ring).

    bash bench/run_h200.sh pipeline     # runs the measurements, then this script

efficiency = measured samples/s / (1 / (t_target + t_drafter)), where t_target (one packed row
through the truncated target) and t_drafter (one drafter step) are measured alone in the same call:
on one GPU the two roles take turns, so their sum is the best a shared GPU can do.
"""

from __future__ import annotations

import argparse
import json
import sys

from common import write_json


def rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def interval_rate(rs: list[dict], skip: int, key: str = "throughput/samples_per_s") -> tuple[float, int]:
    """Samples/s over the logged intervals after step `skip` (compile and warm-up excluded)."""
    kept = [r for r in rs if r.get(key) and r["step"] > skip]
    if not kept:
        raise SystemExit(f"no {key} rows after step {skip}")
    steps = [r["step"] - prev["step"] for prev, r in zip([{"step": skip}] + kept, kept)]
    seconds = sum(n / r[key] for n, r in zip(steps, kept))
    return sum(steps) / seconds, sum(steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-json", required=True, help="bench/target_forward.py output")
    ap.add_argument("--target-variant", default="trunc-flex")
    ap.add_argument("--drafter-json", required=True, help="bench/drafter_step.py output")
    ap.add_argument("--drafter-mode", default="default+ce=triton", help="the mode train.compile=auto runs on a GPU")
    ap.add_argument("--run-dir", required=True, help="run_dir of the 1+1 dflash_mp.main run")
    ap.add_argument("--skip", type=int, default=20, help="steps excluded as warm-up")
    a = ap.parse_args()
    with open(a.target_json) as f:
        tv = next(v for v in json.load(f)["variants"] if v["variant"] == a.target_variant)
    with open(a.drafter_json) as f:
        dm = next(m for m in json.load(f)["modes"] if m["mode"] == a.drafter_mode)
    t_target, t_drafter = tv["ms"], dm["ms_per_step"]
    # The physical limit: every FLOP of both roles per row at the bf16 matmul ceiling (790 TFLOP/s).
    limit = 790 / (tv["tflop"] + dm["tflop_per_step"])
    drafter = rows(f"{a.run_dir}/tb/drafter/scalars.jsonl")
    target = rows(f"{a.run_dir}/tb/target/scalars.jsonl")
    rate, steps = interval_rate(drafter, a.skip)
    ideal = 1000 / (t_target + t_drafter)
    late = [r for r in drafter if r["step"] > a.skip]
    late_t = [r for r in target if r["step"] > a.skip]

    def mean(rs, key):
        vals = [r[key] for r in rs if key in r]
        return sum(vals) / len(vals) if vals else None

    out = {"t_target_ms": t_target, "t_drafter_ms": t_drafter, "ideal_samples_per_s": ideal,
           "measured_samples_per_s": rate, "steps_measured": steps, "efficiency": rate / ideal,
           "physical_limit_samples_per_s": limit, "share_of_limit": rate / limit,
           "drafter_wait_ms_per_step": mean(late, "comm/wait_ms"),
           "target_stall_ms_per_step": mean(late_t, "comm/stall_ms"),
           "drafter_mfu_logged": mean(late, "throughput/mfu"),
           "recompiles_after_warmup": max((r.get("compile/recompiles", 0) for r in drafter), default=None)}
    write_json(out, "pipeline_1gpu.json")
    print(f"\n1+1 on one GPU: t_target {t_target:.1f} ms + t_drafter {t_drafter:.1f} ms -> ideal {ideal:.3f} samples/s; "
          f"measured {rate:.3f} over {steps} steps; efficiency {rate / ideal:.3f}; {rate / limit:.3f} of the "
          f"physical limit {limit:.2f}; drafter wait "
          f"{out['drafter_wait_ms_per_step']} ms/step, target stall {out['target_stall_ms_per_step']} ms/step")


if __name__ == "__main__":
    sys.exit(main())
