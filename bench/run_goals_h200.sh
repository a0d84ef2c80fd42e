#!/usr/bin/env bash
# One device call for issue 31's one-GPU goals, everything at the presets' defaults, on a cold machine:
#   1. the 8B job, 1 target + 1 drafter sharing the GPU, from empty caches (bench/run_rows_h200.sh, ROWS=1);
#   2. the 8B drafter step, $DRAFTER_RUNS timed runs in one process, plus compiled-against-eager losses
#      (DRAFTER_MODES, LOSS_MODE: other modes of bench/drafter_step.py in the same process, e.g.
#      DRAFTER_MODES=default+ce=triton,default+ce=triton+swiglu,default+ce=triton,default+ce=triton+swiglu);
#   3. the 8B target forward, $TARGET_RUNS timed runs in one process.
# From the repo root:  bash bench/run_goals_h200.sh   (under $OUT: run_goals.log, goals.json, the parts' JSON)
# Prints the goals table last.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step
bench_env
LOG=$OUT/run_goals.log
mkdir -p "$OUT"
t0=$SECONDS
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
OUT=$OUT LOG=$LOG ROWS=1 STEPS=${STEPS:-60} SKIP=20 T_JOB=${T_JOB:-240} bash bench/run_rows_h200.sh >/dev/null
grep -h "reduction configs\|cuBLAS workspace" /tmp/dflash_rows/rows1/logs/rank_*.log | cut -c1-200 | tee -a "$LOG"
runs() { printf "$1%.0s," $(seq "$2") | sed 's/,$//'; }
cd bench
step drafter "${T_DRAFTER:-200}" env OUT=/tmp/goals_drafter python3 drafter_step.py --preset qwen3_8b \
    --modes "${DRAFTER_MODES:-$(runs default+ce=triton "${DRAFTER_RUNS:-2}")}" --scope layers --steps 10 --warmup 3 \
    --loss-steps "${LOSS_STEPS:-20}" --loss-mode "${LOSS_MODE:-default+ce=triton}"
cp /tmp/goals_drafter/drafter_qwen3_8b_layers.json "$OUT/goals_drafter.json"
step target "${T_TARGET:-150}" env OUT=/tmp/goals_target python3 target_forward.py --steps 10 \
    --variants "$(runs trunc-triton-compiled-graph "${TARGET_RUNS:-3}")"
cp /tmp/goals_target/target_qwen3_8b.json "$OUT/goals_target.json"
cd ..
step tests 150 python3 -m pytest -q -rfs tests/test_reductions.py tests/test_blas.py
python3 - "$OUT" <<'EOF' | tee -a "$LOG"
import json, os, sys
sys.path.insert(0, "bench")
from modes_table import load
out = sys.argv[1]
drafter, target, jobs = (load(os.path.join(out, n)) for n in ("goals_drafter.json", "goals_target.json", "jobs.json"))
rows = []
def qk(run):  # the q/k norm + RoPE kernels (persistent reductions whose configs Inductor picks)
    keys = ("doc_attention_mean", "cat_mean_mul_neg_pow_rsqrt_split")
    ks = (run.get("profile") or {}).get("top_kernels", [])
    return sum(k["ms"] for k in ks if any(s in k["name"] for s in keys))
steps = [m for m in drafter.get("modes", []) if "ms_per_step" in m]
lm = drafter.get("loss_match", {})
ee = lm.get("eager_vs_eager_dense_attention", {})
def named(m):  # a mode other than the default's says which
    return "" if m["mode"] == "default+ce=triton" else f" ({m['mode'].replace('default+ce=triton', '')})"
rows.append(("1. drafter step <= 114 ms", " / ".join(f"{m['ms_per_step']:.2f}{named(m)}" for m in steps),
             " / ".join(f"{m['mfu']:.3f}" for m in steps),
             f"q/k norm kernels {[round(qk(m), 3) for m in steps]} ms, "
             f"recompiles {[m.get('recompiles_after_warmup') for m in steps]}, compiled ({lm.get('mode')}) vs eager loss "
             f"{lm.get('mean_rel_diff', float('nan')):.2%} mean / {lm.get('max_rel_diff', float('nan')):.2%} max, "
             f"eager dense vs Triton {ee.get('mean_rel_diff', float('nan')):.2%} / {ee.get('max_rel_diff', float('nan')):.2%}"))
fwd = [v for v in target.get("variants", []) if "ms" in v]
rows.append(("2. target forward <= 66 ms", " / ".join(f"{v['ms']:.2f}" for v in fwd),
             " / ".join(f"{v['mfu']:.3f}" for v in fwd),
             f"q/k norm kernels {[round(qk(v), 3) for v in fwd]} ms, recompiles {[v.get('recompiles') for v in fwd]}"))
job = next(iter(jobs.values()), {})
if job:
    rows.append(("3. 1+1 job >= 5.3 rows/s", f"{job['measured_samples_per_s']:.3f} rows/s",
                 f"{job['measured_samples_per_s'] / 7.07:.3f} of 7.07",
                 f"wait {job['drafter_wait_ms_per_step']:.2f} ms/step, recompiles {job['recompiles_after_warmup']}"))
summary = {"device": drafter.get("device") or target.get("device"), "torch": drafter.get("torch"),
           "reduction_configs": [drafter.get("reduction_configs"), target.get("reduction_configs")], "goals": rows}
with open(os.path.join(out, "goals.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(f"\n{summary['device']}, torch {summary['torch']}")
print(f"{'goal':28} | {'measured':24} | {'MFU / fraction':24} | notes")
for r in rows:
    print(f"{r[0]:28} | {r[1]:24} | {r[2]:24} | {r[3]}")
EOF
echo "== done at $((SECONDS - t0)) s" | tee -a "$LOG"
