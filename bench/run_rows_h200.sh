#!/usr/bin/env bash
# The 8B job on one H200 (1 target + 1 drafter sharing the GPU, experiment=qwen3_8b at its defaults)
# with the target forwarding $ROWS rows at a time (target.rows_per_forward), one job per value, in order:
#   ROWS="2 1" STEPS=80 T_JOB=330 bash bench/run_rows_h200.sh
# The first job compiles from the Inductor cache as found (empty on a fresh machine); the later ones find
# the drafter's graphs it compiled (the target's differ by row count). Prints per job the samples/s over
# steps SKIP..STEPS (bench/pipeline.py --jobs), the drafter's data wait per step and the recompiles;
# writes jobs.json (bench/pipeline.py --jobs) and each job's scalars under $OUT (or bench/results).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step, long_chats
bench_env
W=${W:-/tmp/dflash_rows}
LOG="$OUT/run_rows.log"
mkdir -p "$W" "$OUT"
t0=$SECONDS
long_chats "$W/long_chats.jsonl" 600
for r in ${ROWS:-2 1}; do
    step "job_rows$r" "${T_JOB:-330}" torchrun --standalone --nproc-per-node 2 -m dflash_mp.main \
        experiment=qwen3_8b target.path=builtin:random-qwen3-8b data.path="$W/long_chats.jsonl" \
        train.max_steps="${STEPS:-80}" logging.log_every=10 logging.progress=false checkpoint.every=0 \
        checkpoint.overwrite=true run_dir="$W/rows$r" target.rows_per_forward="$r" ${JOB_ARGS:-}
    grep -hE "first (step|target forward)|recompile|captured|rows_per|Error|error" "$W/rows$r"/logs/rank_*.log \
        2>/dev/null | cut -c1-200 | tail -12 >> "$LOG"
    for role in drafter target; do
        cp "$W/rows$r/tb/$role/scalars.jsonl" "$OUT/rows${r}_${role}_scalars.jsonl" 2>/dev/null
    done
done
dirs=$(for r in ${ROWS:-2 1}; do echo "$W/rows$r"; done)
(cd bench && python3 pipeline.py --skip "${SKIP:-20}" --jobs $dirs) 2>&1 | tee -a "$LOG"
echo "== done at $((SECONDS - t0)) s" | tee -a "$LOG"
