#!/usr/bin/env bash
# The single-GPU figures of BENCHMARKS.md in one device call (from the repo root on the GPU host):
#   bash bench/run_h200.sh            # JSON + one log to $OUT (the lent machine) or bench/results
# Order: the drafter step in every mode (its figures also give t_drafter), the target forward
# alone (t_target), then the 1+1 pipeline on this one GPU (issue 5). Each step has its own time limit
# so one slow compile cannot lose the others' figures. A warm Inductor cache (TORCHINDUCTOR_CACHE_DIR)
# turns minutes of kernel compilation into seconds.
set -u
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-$PWD/bench/results}"
PIPE=${PIPE:-/tmp/dflash_pipe}
LOG="$OUT/run_h200.log"
export OUT
mkdir -p "$PIPE"
step() {  # step NAME SECONDS CMD...: run with a limit, log, say how it ended
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "== $name" >> "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    echo "== $name rc $? in $((SECONDS - t0)) s" | tee -a "$LOG"
}
step drafter_8b "${T_DRAFTER:-170}" python3 bench/drafter_step.py --preset qwen3_8b \
    --modes eager,default,default+loss,reduce-overhead --scope layers --loss-steps 50 --loss-mode default \
    --steps 10 --warmup 3
step target_alone "${T_TARGET:-150}" env OUT="$PIPE" python3 bench/target_forward.py --variants trunc-flex --steps 20
python3 -m dflash_mp.demo make-data --out "$PIPE/long_chats.jsonl" --num 600 --turns 48 --seed 1 >> "$LOG" 2>&1
step pipeline_1p1 "${T_PIPE:-220}" torchrun --standalone --nproc-per-node 2 -m dflash_mp.main experiment=qwen3_8b \
    target.path=builtin:random-qwen3-8b target.compile=false data.path="$PIPE/long_chats.jsonl" train.max_steps=80 \
    logging.log_every=10 logging.progress=false checkpoint.every=0 run_dir="$PIPE/run"
cp "$PIPE/run/tb/drafter/scalars.jsonl" "$OUT/pipe_drafter_scalars.jsonl" 2>/dev/null
cp "$PIPE/run/tb/target/scalars.jsonl" "$OUT/pipe_target_scalars.jsonl" 2>/dev/null
cp "$PIPE/target_qwen3_8b.json" "$OUT/pipe_target_alone.json" 2>/dev/null
(cd bench && python3 pipeline.py --target-json "$PIPE/target_qwen3_8b.json" --drafter-json "$OUT/drafter_qwen3_8b_layers.json" \
    --run-dir "$PIPE/run") 2>&1 | tee -a "$LOG"
grep -E "compile:|topology|share|Error" "$LOG" | grep -v -i warn | tail -8 | cut -c1-250
grep -A8 "^qwen3_8b on" "$LOG"
grep -E "GPU ms/step by kernel class|loss match" "$LOG" | cut -c1-300
