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


def mean(rs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rs if key in r]
    return sum(vals) / len(vals) if vals else None


def job_figures(run_dir: str, skip: int) -> dict:
    """A dflash_mp.main run's drafter figures after step `skip`: samples/s, the steps it covers, the
    data wait per step, the logged MFU and the recompiles after warm-up."""
    drafter = rows(f"{run_dir}/tb/drafter/scalars.jsonl")
    rate, steps = interval_rate(drafter, skip)
    late = [r for r in drafter if r["step"] > skip]
    return {"measured_samples_per_s": rate, "steps_measured": steps,
            "drafter_wait_ms_per_step": mean(late, "comm/wait_ms"),
            "drafter_mfu_logged": mean(late, "throughput/mfu"),
            "recompiles_after_warmup": max((r.get("compile/recompiles", 0) for r in drafter), default=None)}


def jobs_table(run_dirs: list[str], skip: int, limit: float = 7.07, name: str = "jobs.json") -> None:
    """`--jobs`: several runs side by side (bench/run_rows_h200.sh), into `name` (`--json`), each against
    the physical limit `limit` rows/s (`--limit`: 7.07 is the 8B's on one H200, 2.96 the 27B's)."""
    out = {}
    print(f"run | samples/s | of {limit:g} | steps | drafter wait ms/step | recompiles")
    for d in run_dirs:
        try:
            f = out[d] = job_figures(d, skip)
        except (OSError, SystemExit) as e:
            print(f"{d} | no figure ({e})")
            continue
        print(f"{d} | {f['measured_samples_per_s']:.3f} | {f['measured_samples_per_s'] / limit:.3f} | "
              f"{f['steps_measured']} | {f['drafter_wait_ms_per_step']} | {f['recompiles_after_warmup']}")
    write_json(out, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", nargs="+", help="run dirs to compare (needs neither JSON)")
    ap.add_argument("--limit", type=float, default=7.07,
                    help="--jobs: the physical limit in rows/s (BENCHMARKS.md: 7.07 the 8B's, 2.96 the 27B's)")
    ap.add_argument("--json", default="jobs.json", help="--jobs: the file it writes (under $OUT or bench/results); "
                                                        "name it per call where several runs share one $OUT")
    ap.add_argument("--target-json", help="bench/target_forward.py output")
    ap.add_argument("--target-variant", default="trunc-flex")
    ap.add_argument("--drafter-json", help="bench/drafter_step.py output")
    ap.add_argument("--drafter-mode", default="default+ce=triton", help="the mode train.compile=auto runs on a GPU")
    ap.add_argument("--run-dir", help="run_dir of the 1+1 dflash_mp.main run")
    ap.add_argument("--skip", type=int, default=20, help="steps excluded as warm-up")
    a = ap.parse_args()
    if a.jobs:
        return jobs_table(a.jobs, a.skip, a.limit, a.json)
    if not (a.target_json and a.drafter_json and a.run_dir):
        ap.error("--target-json, --drafter-json and --run-dir are required (or --jobs)")
    with open(a.target_json) as f:
        tv = next(v for v in json.load(f)["variants"] if v["variant"] == a.target_variant)
    with open(a.drafter_json) as f:
        dm = next(m for m in json.load(f)["modes"] if m["mode"] == a.drafter_mode)
    t_target, t_drafter = tv["ms"], dm["ms_per_step"]
    # The physical limit: every FLOP of both roles per row at the bf16 matmul ceiling (790 TFLOP/s).
    limit = 790 / (tv["tflop"] + dm["tflop_per_step"])
    job = job_figures(a.run_dir, a.skip)
    rate, steps = job["measured_samples_per_s"], job["steps_measured"]
    ideal = 1000 / (t_target + t_drafter)
    late_t = [r for r in rows(f"{a.run_dir}/tb/target/scalars.jsonl") if r["step"] > a.skip]
    out = {"t_target_ms": t_target, "t_drafter_ms": t_drafter, "ideal_samples_per_s": ideal, **job,
           "efficiency": rate / ideal, "physical_limit_samples_per_s": limit, "share_of_limit": rate / limit,
           "target_stall_ms_per_step": mean(late_t, "comm/stall_ms")}
    write_json(out, "pipeline_1gpu.json")
    print(f"\n1+1 on one GPU: t_target {t_target:.1f} ms + t_drafter {t_drafter:.1f} ms -> ideal {ideal:.3f} samples/s; "
          f"measured {rate:.3f} over {steps} steps; efficiency {rate / ideal:.3f}; {rate / limit:.3f} of the "
          f"physical limit {limit:.2f}; drafter wait "
          f"{out['drafter_wait_ms_per_step']} ms/step, target stall {out['target_stall_ms_per_step']} ms/step")


if __name__ == "__main__":
    sys.exit(main())
