#!/usr/bin/env bash
# BENCHMARKS.md "Staged targets": the Qwen3-8B target (random weights) in 2 stages + 1 drafter, all
# three ranks on one GPU over the shm ring, against the same job in 1 stage (1 + 1), in one call:
#   bash bench/run_stages_h200.sh
# Then each stage's forward alone (its busy fraction = that time x the staged run's samples/s) and the
# summary table. JSON + logs go to $OUT (the lent machine) or bench/results.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step, long_chats
bench_env
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}
W=${W:-/tmp/dflash_stages}
LOG="$OUT/stages.log"
mkdir -p "$OUT" "$W"
t0=$SECONDS
long_chats "$W/long_chats.jsonl" 600
JOB="experiment=qwen3_8b target.path=builtin:random-qwen3-8b target.compile=${TARGET_COMPILE:-false}
     data.path=$W/long_chats.jsonl train.max_steps=${STEPS:-80} logging.log_every=10 logging.progress=false
     checkpoint.every=0 checkpoint.overwrite=true"
# The staged run first: it pays the cold drafter compile, the second finds Inductor's cache warm.
step staged_2 "${T_STAGED:-330}" torchrun --standalone --nproc-per-node 3 -m dflash_mp.main $JOB \
    target.stages=2 topology.num_target_ranks=2 run_dir="$W/staged"
step one_stage "${T_ONE:-200}" torchrun --standalone --nproc-per-node 2 -m dflash_mp.main $JOB run_dir="$W/one"
for r in staged one; do
    cp "$W/$r/tb/drafter/scalars.jsonl" "$OUT/${r}_drafter_scalars.jsonl" 2>/dev/null
    cp "$W/$r/tb/target/scalars.jsonl" "$OUT/${r}_target_scalars.jsonl" 2>/dev/null
done
cd bench
step alone "${T_ALONE:-150}" python3 stages.py alone --stages 1,2 $([ "${TARGET_COMPILE:-false}" = true ] && echo --compile)
python3 stages.py summary --one "$W/one" --staged "$W/staged" --alone "$OUT/stage_alone.json" 2>&1 | tee -a "$LOG"
grep -hE "target stages|recompiles after warm-up|packs exactly|failed|Error" "$W"/*/logs/rank_*.log | cut -c1-240 | head -20
cd "$W" && tar czf "$OUT/stages_logs.tgz" staged/logs one/logs 2>/dev/null
