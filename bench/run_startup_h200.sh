#!/usr/bin/env bash
# Start-up, restart, followers and checkpoints of the README's production job on ONE H200 (issue 29),
# every run from empty Inductor and Triton caches (a fresh node):
#   bash bench/run_startup_h200.sh [PART...]   # PART: job8 followers tests (default: all three)
#   job8       experiment=qwen3_8b, 1 target + 1 drafter sharing the GPU, checkpoint every 20 steps;
#              SIGTERM once step 50 is logged (a stop mid-run: exit code and checkpoint); then a restart
#              with checkpoint.resume=auto into new empty caches: the run's saved artifacts only
#   followers  the same job with 1 target + 2 drafters on the GPU: one drafter compiles, the other loads
#   tests      tests/test_compile_cache_gpu.py (zero FX/AOT misses after a restart into empty caches)
# Results under $OUT (or bench/results): run_startup.log, startup.json, each run's drafter scalars.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step, long_chats
bench_env
W=${W:-/root/startup_work}
LOG="$OUT/run_startup.log"
PARTS=${*:-job8 followers tests}
mkdir -p "$W" "$OUT"
t0=$SECONDS
has() { [[ " $PARTS " == *" $1 "* ]]; }
fresh() {  # fresh NAME: empty compile caches, as on a node that never ran the job
    export TORCHINDUCTOR_CACHE_DIR="$W/inductor_$1" TRITON_CACHE_DIR="$W/triton_$1"
    rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
}
DATA="$W/long_chats.jsonl"
long_chats "$DATA" 600
# $EXP replaces the preset (a CPU dry run of this script: EXP="train.compile=eager")
JOB=(${EXP:-experiment=qwen3_8b target.path=builtin:random-qwen3-8b} data.path="$DATA" logging.log_every=10
     logging.progress=false)
stop_at() {  # stop_at RUN_DIR STEP PID: SIGTERM to torchrun's workers once the drafter has logged STEP
    # (as launch/env.sh passes a scheduler's stop: torchrun signalled itself tears them down, exit 1)
    until grep -q "\"step\": $2," "$1/tb/drafter/scalars.jsonl" 2>/dev/null; do
        kill -0 "$3" 2>/dev/null || return
        sleep 0.5
    done
    echo "== SIGTERM after step $2 at $((SECONDS - t0)) s" >> "$LOG"
    pkill -TERM -P "$3"
}
if has job8; then
    R="$W/job8"
    rm -rf "$R"
    fresh job8_cold
    echo "== job8_cold" >> "$LOG"
    t=$SECONDS
    torchrun --standalone --nproc-per-node 2 -m dflash_mp.main "${JOB[@]}" run_dir="$R" train.max_steps=100 \
        checkpoint.every=20 >> "$LOG" 2>&1 &
    pid=$!
    stop_at "$R" 50 "$pid" &
    ( sleep "${T_COLD:-300}"; kill -KILL "$pid" 2>/dev/null ) & guard=$!
    wait "$pid"; rc=$?
    kill "$guard" 2>/dev/null
    echo "== job8_cold rc $rc in $((SECONDS - t)) s (at $((SECONDS - t0)) s)" | tee -a "$LOG"
    cp "$R/tb/drafter/scalars.jsonl" "$OUT/job8_cold_drafter.jsonl" 2>/dev/null
    mkdir -p "$W/logs_cold" && cp "$R"/logs/rank_*.log "$W/logs_cold/" 2>/dev/null
    fresh job8_restart
    step job8_restart "${T_RESTART:-200}" torchrun --standalone --nproc-per-node 2 -m dflash_mp.main "${JOB[@]}" \
        run_dir="$R" train.max_steps=100 checkpoint.every=20 checkpoint.resume=auto
    cp "$R/tb/drafter/scalars.jsonl" "$OUT/job8_restart_drafter.jsonl" 2>/dev/null
    grep -hE "first (drafter step|target forward)|compile cache|checkpoint of step|recompiles|SIGTERM|stopped|resumed|Hiccup|slower than" \
        "$W"/logs_cold/rank_*.log "$R"/logs/rank_*.log | cut -c1-200 >> "$LOG"
fi
if has followers; then
    R="$W/followers"
    rm -rf "$R"
    fresh followers
    step followers "${T_FOLLOWERS:-240}" torchrun --standalone --nproc-per-node 3 -m dflash_mp.main "${JOB[@]}" \
        run_dir="$R" train.max_steps=40 checkpoint.every=0 topology.num_target_ranks=1
    cp "$R/tb/drafter/scalars.jsonl" "$OUT/followers_drafter.jsonl" 2>/dev/null
    grep -hE "first (drafter step|target forward)|compile cache|recompiles" "$R"/logs/rank_*.log | cut -c1-200 >> "$LOG"
fi
if has tests; then
    fresh tests
    step gpu_tests "${T_TESTS:-200}" python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_compile_cache_gpu.py
fi
grep -E "^== |^\[.*(first (drafter step|target forward)|compile cache: (loaded|waited)|paused|written in|recompiles|resumed|stopped)|passed|failed|first two steps" "$LOG" | cut -c1-200
