#!/usr/bin/env bash
# The target's RMSNorm weights folded into the projections that read them (target.fold_norms,
# target/fold.py), in one device call at the 8B target's shapes:
#   1. the forward at the default against `-fold`, alternating, $RUNS times each, then `-foldcheck` (the fold as
#      a job's load does it, checked layer by layer; last, since it folds for good), in one process
#      (bench/target_forward.py: each forward's time, and the forwards back to back as a job runs them);
#   2. with JOB=1, the 8B job (1 target + 1 drafter on the GPU) with target.fold_norms=true, from empty caches.
# The Inductor cache's generated code is kept (inductor_py.tgz): it shows what the folded layers' kernels do.
# From the repo root:  bash bench/run_fold_h200.sh   (under $OUT: run_fold.log, fold_target.json,
# inductor_py.tgz; with JOB=1 also run_rows.log, jobs.json). Prints the forward's table last.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step
bench_env
LOG=$OUT/run_fold.log
mkdir -p "$OUT"
t0=$SECONDS
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fold_inductor}
variants=$(for _ in $(seq "${RUNS:-3}"); do printf "trunc-triton-compiled-graph,trunc-triton-compiled-fold-graph,"; done)
(cd bench && step target "${T_TARGET:-260}" env OUT=/tmp/fold_target python3 target_forward.py --steps 20 \
    --variants "${variants}trunc-triton-compiled-foldcheck-graph")
cp /tmp/fold_target/target_qwen3_8b.json "$OUT/fold_target.json"
(cd "$TORCHINDUCTOR_CACHE_DIR" && find . -name "*.py" | tar czf "$OUT/inductor_py.tgz" -T -) 2>/dev/null
if [ "${JOB:-0}" = 1 ]; then
    OUT=$OUT LOG=$LOG ROWS=1 STEPS=${STEPS:-60} SKIP=20 T_JOB=${T_JOB:-240} JOB_ARGS="target.fold_norms=true" \
        TORCHINDUCTOR_CACHE_DIR=/tmp/fold_job_inductor bash bench/run_rows_h200.sh > /dev/null
    grep -h "folded\|compiled layers equal\|packs exactly" /tmp/dflash_rows/rows1/logs/rank_*.log | cut -c1-200 \
        | tee -a "$LOG"
fi
sed -n '/^target forward, T=/,$p' "$LOG" | head -12
echo "== done at $((SECONDS - t0)) s" | tee -a "$LOG"
