#!/usr/bin/env bash
# The planner's memory floor and estimate (python -m dflash_mp.plan) against what one GPU holds:
#   1. the CUDA tests of the target's load check (weights over the GPU's free memory are refused at once)
#      and of what a built trainer leaves cached (tests/test_gpu_memory.py);
#   2. the planner on this GPU for the 8B and 27B presets (floor and estimate of each role);
#   3. the drafter step alone of PRESET (qwen3_8b, the default, or qwen3_5_27b: a preset of
#      bench/drafter_step.py with an experiment of the same name for the planner's estimate), launched
#      from Python (+nograph: its allocated peak is weights, training state and one step's activations),
#      captured as a CUDA graph (the default), and captured keeping what the build left cached
#      (+keepcache): reserved once built, the peaks over build and warm-up (what a job's
#      memory/max_reserved_gib counts) and reserved over the timed steps; with EXPANDABLE=1, the
#      EXPANDABLE_MODES again in a process whose allocator grows expandable segments
#      (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True);
#   4. with JOB_DIR, the run directory of an 8B job at its defaults: each role's peaks and what it held last.
# From the repo root, after a job compiled the drafter (its Inductor cache then serves step 3):
#   ROWS=1 STEPS=40 bash bench/run_rows_h200.sh; JOB_DIR=/tmp/dflash_rows/rows1 bash bench/run_memory_check.sh
# The 27B drafter's steps at the default and under expandable segments (~4 minutes on a cold H100):
#   PRESET=qwen3_5_27b MEMORY_MODES=default+ce=triton EXPANDABLE=1 bash bench/run_memory_check.sh
# The modes of MEMORY_MODES share one process and its Inductor cache: a later mode's first step skips the
# kernel timing an earlier one did. First-step peaks from empty caches take a process each (call Q14 of
# BENCHMARKS.md: drafter_step.py once per mode, each with a TORCHINDUCTOR_CACHE_DIR of its own).
# Writes memory_check.log and memory_check.json under $OUT; prints the table last.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step
bench_env
LOG=$OUT/memory_check.log
mkdir -p "$OUT"
t0=$SECONDS
step loadcheck 150 python3 -m pytest -q -p no:cacheprovider \
    "tests/test_stages.py::test_on_a_gpu_the_target_load_refuses_weights_that_do_not_fit_its_free_memory" \
    tests/test_gpu_memory.py
for run in "qwen3_8b plan.world_size=1" "qwen3_5_27b plan.world_size=1" "qwen3_5_27b plan.world_size=8"; do
    # shellcheck disable=SC2086  # the experiment and the world size are two arguments
    step "plan $run" 90 python3 -m dflash_mp.plan experiment=$run
done
PRESET=${PRESET:-qwen3_8b}
(cd bench && step drafter "${T_DRAFTER:-240}" env OUT=/tmp/memory_drafter python3 drafter_step.py --preset "$PRESET" \
    --modes "${MEMORY_MODES:-default+ce=triton+nograph,default+ce=triton,default+ce=triton+keepcache}" \
    --scope layers --steps 6 --warmup 3 --loss-steps 0)
cp "/tmp/memory_drafter/drafter_${PRESET}_layers.json" "$OUT/memory_drafter.json" 2>/dev/null
if [ "${EXPANDABLE:-0}" = 1 ]; then
    (cd bench && step "drafter, expandable segments" "${T_DRAFTER:-240}" env OUT=/tmp/memory_drafter_expandable \
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 drafter_step.py --preset "$PRESET" \
        --modes "${EXPANDABLE_MODES:-default+ce=triton}" --scope layers --steps 6 --warmup 3 --loss-steps 0)
    cp "/tmp/memory_drafter_expandable/drafter_${PRESET}_layers.json" "$OUT/memory_drafter_expandable.json" 2>/dev/null
fi
python3 - "$OUT" "${JOB_DIR:-}" "$PRESET" <<'EOF' | tee -a "$LOG"
import json, os, sys

from dflash_mp.config import compose
from dflash_mp.plan import memory_floor, planned_ids, target_config_for
from dflash_mp.split import GIB
from dflash_mp.target import TargetSpec

out, job_dir, preset = sys.argv[1:4]
job = compose([f"experiment={preset}"])
tcfg = target_config_for(job)
spec = TargetSpec.from_config(tcfg)
ids, mask = planned_ids(job, tcfg, spec)
f = memory_floor(job, tcfg, spec, ids, mask, [(0, max(ids) + 1)])
rows = []
# (what, reserved once built, peak reserved over build and warm-up, peak allocated then, reserved over the steps)
for name, how in (("memory_drafter.json", ""), ("memory_drafter_expandable.json", ", expandable segments")):
    try:
        with open(os.path.join(out, name)) as fh:
            modes = json.load(fh)["modes"]
    except (OSError, KeyError, ValueError):
        modes = []
    for m in modes:
        rows.append((f"{preset} drafter alone, {m['mode']}{how}", m.get("built_reserved_gib"),
                     m.get("warmup_peak_reserved_gib"), m.get("warmup_peak_allocated_gib"), m.get("peak_reserved_gib")))
for role in ("drafter", "target"):
    scalars = os.path.join(job_dir, "tb", role, "scalars.jsonl") if job_dir else ""
    if scalars and os.path.exists(scalars):
        logged = [json.loads(ln) for ln in open(scalars)]
        last = {k: v for d in logged for k, v in d.items() if k.startswith("memory/")}
        if last:  # the run's peaks (warm-up included) and what it held at its last log
            rows.append((f"{preset} job's {role} rank (1 + 1 on the GPU)", None, last.get("memory/max_reserved_gib"),
                         last.get("memory/max_allocated_gib"), last.get("memory/reserved_gib")))
est = (f.drafter + f.drafter_step) / GIB
print(f"planner, {preset} drafter rank: floor {f.drafter / GIB:.2f} GiB, estimate {est:.2f}; "
      f"target rank: floor {f.target / GIB:.2f}, estimate {(f.target + f.target_step) / GIB:.2f}")
heads = ("built, reserved", "peak reserved", "peak allocated", "steps, reserved", "peak / estimate")
print(f"{'measured (GiB)':72} " + " ".join(f"{h:>16}" for h in heads))
for name, built, peak, alloc, steady in rows:
    ratio = peak / est if peak is not None and "target" not in name else None
    print(f"{name:72} " + " ".join(f"{v:16.2f}" if v is not None else f"{'-':>16}"
                                   for v in (built, peak, alloc, steady, ratio)))
json.dump({"floor_gib": f.drafter / GIB, "estimate_gib": est,
           "target_floor_gib": f.target / GIB, "target_estimate_gib": (f.target + f.target_step) / GIB,
           "measured": [dict(zip(("what", "built_reserved_gib", "peak_reserved_gib", "peak_allocated_gib",
                                  "steps_reserved_gib"), r)) for r in rows]},
          open(os.path.join(out, "memory_check.json"), "w"), indent=1)
EOF
echo "== done at $((SECONDS - t0)) s" | tee -a "$LOG"
