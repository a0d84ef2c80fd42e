#!/usr/bin/env bash
# Multi-GPU figures of BENCHMARKS.md (from the repo root on a host with 2+ GPUs):
#   bash bench/run_multigpu.sh [PART...]
#   tests   the 2-GPU start-up tests (tests/test_multigpu.py)
#   ring    transport GB/s per pair, Qwen3-8B-sized rows, p2p and shm across GPUs (bench/ring.py)
#   cold    the README production job on ONE GPU (1+1 sharing it) from an empty Inductor cache,
#           no timeout override: exit code, time to first step, samples/s (fills the cache)
#   splits  the production job on every split of the lent GPUs, warm cache (RUN_SPLITS below)
#   plan    the planner's prediction, estimated and measured (plan.measure=true), for the same GPUs
# Each job's run dir and log go to $WORK; per-run figures to $OUT/splits.json (bench/splits.py).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step, long_chats
bench_env
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.indcache}
WORK=${WORK:-$PWD/.mgpu}
PARTS=${*:-tests ring cold splits plan}
STEPS=${STEPS:-110}
LOG="$OUT/run_multigpu.log"
mkdir -p "$WORK" "$OUT"
t0=$SECONDS
has() { [[ " $PARTS " == *" $1 "* ]]; }
step_json() {  # step_json NAME SECONDS CMD...: step, and its rc and wall time into $WORK/rc.jsonl
    local name=$1 t=$SECONDS
    step "$@"
    echo "{\"name\": \"$name\", \"rc\": $STEP_RC, \"wall_s\": $((SECONDS - t))}" >> "$WORK/rc.jsonl"
}
DATA="$WORK/long_chats.jsonl"
long_chats "$DATA" 600
JOB=(experiment=qwen3_8b target.path=builtin:random-qwen3-8b data.path="$DATA" train.max_steps="$STEPS"
     logging.log_every=10 logging.progress=false checkpoint.every=0)
job() {  # job NAME LIMIT NPROC [OVERRIDES...]: one production run, its dir kept for splits.py
    local name=$1 limit=$2 n=$3
    shift 3
    rm -rf "$WORK/$name"
    step_json "$name" "$limit" torchrun --standalone --nproc-per-node "$n" -m dflash_mp.main "${JOB[@]}" \
        run_dir="$WORK/$name" "$@"
    cp "$WORK/$name"/tb/drafter/scalars.jsonl "$OUT/${name}_drafter.jsonl" 2>/dev/null
}
if has tests; then
    step_json gpu_tests "${T_TESTS:-200}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_multigpu.py \
        tests/test_transport_p2p.py
fi
if has ring; then
    for kind in p2p shm; do
        step_json "ring_$kind" 120 torchrun --standalone --nproc-per-node 2 bench/ring.py --kind "$kind" --batches 100
    done
fi
if has cold; then
    [ -n "${KEEP_CACHE:-}" ] || rm -rf "$TORCHINDUCTOR_CACHE_DIR"
    CUDA_VISIBLE_DEVICES=0 job cold_1gpu_1p1 "${T_COLD:-560}" 2
fi
if has splits; then
    for s in ${RUN_SPLITS:-w2_1p1_p2p w2_1p1_shm w4_2p2 w3_1p2}; do
        case $s in
            w2_1p1_p2p) job "$s" ${T_SPLIT:-240} 2 topology.num_target_ranks=1 transport.kind=p2p ;;
            w2_1p1_shm) job "$s" 240 2 topology.num_target_ranks=1 transport.kind=shm ;;
            w4_2p2) job "$s" ${T_SPLIT:-300} 4 topology.num_target_ranks=2 ;;
            w3_1p2) job "$s" ${T_SPLIT:-300} 3 topology.num_target_ranks=1 ;;
            w4_1p3) job "$s" 300 4 topology.num_target_ranks=1 ;;
        esac
    done
fi
if has plan; then
    step_json plan_estimate 60 python3 -m dflash_mp.plan experiment=qwen3_8b plan.world_size=2
    step_json plan_measure 240 python3 -m dflash_mp.plan experiment=qwen3_8b plan.world_size=2 plan.measure=true
fi
python3 bench/splits.py "$WORK" | tee "$OUT/splits.txt"
grep -E "^(transport|p2p|shm) " -A0 "$LOG" | cut -c1-120
grep -E "first (drafter step|target forward) done|failed|Error" "$LOG" | cut -c1-200 | head -40
grep -E "^ +[0-9.]+ +[0-9]+ target|<- best|measured on|per GPU" "$LOG" | head -20
