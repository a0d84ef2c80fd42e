#!/usr/bin/env bash
# The single-GPU figures of BENCHMARKS.md (from the repo root on the GPU host):
#   bash bench/run_h200.sh [PART...]   # PART: warm tests ce drafter tiles target doctiles small pipeline (default: all)
# JSON + logs go to $OUT (the lent machine) or bench/results.
#   warm      compile every graph the timed parts need, in the background, while `tests` runs:
#             compiling is CPU work, and nothing is timed before it is done
#   tests     the CUDA-only tests (compiled steps match eager, no hidden GPU sync, shm over CUDA IPC)
#   drafter   Qwen3-8B drafter step: eager / compiled variants in one run + 50-step loss match (issue 4.1)
#   tiles     flex_attention tile sizes on the 8B drafter's block mask (bench/flex_tiles.py)
#   ce        one fused-CE chunk at 8B shapes per loss kernel, and the Triton kernels' tiles (bench/ce_chunk.py)
#   target    Qwen3-8B target forward variants with kernel profiles (issue 4.3)
#   doctiles  one 8B target layer's attention: flex_attention against the Triton kernel's tiles (bench/doc_attn_tiles.py)
#   small     ~0.6B drafter, launch-bound: eager vs default vs reduce-overhead (issue 4.2)
#   pipeline  1+1 ranks sharing the GPU at Qwen3-8B shapes, at defaults and with topology.gpu_turns=off
#             ($PIPE_TURNS: the gpu_turns values to run, $PIPE_STEPS, $PIPE_ARGS: more overrides;
#             the parts alone: $PIPE_DRAFTER_MODE of the drafter part's JSON, the target part's JSON or
#             $PIPE_TARGET_JSON's $PIPE_TARGET_VARIANT, else a target run of its own)
# A warm Inductor cache (TORCHINDUCTOR_CACHE_DIR) turns minutes of kernel compilation into seconds.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step, long_chats
bench_env
PIPE=${PIPE:-/tmp/dflash_pipe}
LOG="$OUT/run_h200.log"
PARTS=${*:-warm tests ce drafter tiles target doctiles small pipeline}
# The GPU default (Triton CE, Triton block attention), then the same with flex_attention.
DRAFTER_MODES=${DRAFTER_MODES:-default+ce=triton,default+ce=triton+attn=flex}
WARM_MODES=${WARM_MODES:-$DRAFTER_MODES}  # the 8B modes compiled during `warm`
LOSS_STEPS=${LOSS_STEPS:-50}
SMALL_MODES=${SMALL_MODES:-eager,default,default+loss,reduce-overhead,reduce-overhead+loss}
export OUT
mkdir -p "$PIPE"
t0=$SECONDS
has() { [[ " $PARTS " == *" $1 "* ]]; }
warm_jobs=()
if has warm; then  # throw-away runs whose only product is the Inductor cache (for the parts asked for)
    W=$(mktemp -d)
    has drafter && { (cd bench && OUT=$W TORCHINDUCTOR_COMPILE_THREADS=6 timeout "${T_WARM:-330}" python3 drafter_step.py \
        --preset qwen3_8b --modes "$WARM_MODES" --scope layers --steps 1 --warmup 2 > "$W/w8b.log" 2>&1) & warm_jobs+=($!); }
    has small && { (cd bench && OUT=$W TORCHINDUCTOR_COMPILE_THREADS=6 timeout "${T_WARM:-330}" python3 drafter_step.py \
        --preset qwen3_0p6b --modes "${SMALL_WARM_MODES:-default+ce=triton}" --scope layers --steps 1 --warmup 2 \
        > "$W/w06.log" 2>&1) & warm_jobs+=($!); }
    has target && { (cd bench && OUT=$W TORCHINDUCTOR_COMPILE_THREADS=4 timeout "${T_WARM:-330}" python3 target_forward.py \
        --variants "${TARGET_WARM:-trunc-triton-compiled-graph,trunc-flex-compiled}" --steps 1 > "$W/wt.log" 2>&1) & warm_jobs+=($!); }
fi
if has tests; then
    step gpu_tests "${T_TESTS:-330}" env TORCHINDUCTOR_COMPILE_THREADS=4 python3 -m pytest -q -rs -p no:cacheprovider \
        ${GPU_TESTS:-tests/test_trainer_compile.py tests/test_optim.py tests/test_transport_shm.py::test_cuda_stream \
        tests/test_drafter.py::test_flex_matches_dense_on_cuda_and_compiled_step_never_recompiles \
        tests/test_ce_kernels.py tests/test_block_attn.py tests/test_doc_attn.py}
fi
for j in "${warm_jobs[@]}"; do wait "$j"; done
if has warm; then
    echo "== warm-up done at $((SECONDS - t0)) s: $(tail -qn1 "$W"/*.log | cut -c1-80 | tr '\n' ' ')" | tee -a "$LOG"
    # CACHE_OUT: also ship the now-warm cache back (for the next device call), in parts of 15 MB.
    [ -n "${CACHE_OUT:-}" ] && (tar czf - -C "$(dirname "$TORCHINDUCTOR_CACHE_DIR")" "$(basename "$TORCHINDUCTOR_CACHE_DIR")" \
        | split -b 15M - "$CACHE_OUT/ind.tgz."; mb=$(du -cm "$CACHE_OUT"/ind.tgz.* | tail -1 | cut -f1)
        [ "$mb" -gt 60 ] && rm -f "$CACHE_OUT"/ind.tgz.* && echo "== cache of $mb MB: too large to ship" >> "$LOG") &
fi
cd bench
has ce && step ce_chunk "${T_CE:-120}" python3 ce_chunk.py ${CE_VARIANTS:+--variants "$CE_VARIANTS"}
has drafter && step drafter_8b "${T_DRAFTER:-200}" python3 drafter_step.py --preset qwen3_8b --modes "$DRAFTER_MODES" \
    --scope layers --loss-steps "$LOSS_STEPS" --loss-mode "${LOSS_MODE:-default+ce=triton}" --steps 10 --warmup 3 ${DRAFTER_ARGS:-}
has tiles && step flex_tiles "${T_TILES:-300}" python3 flex_tiles.py ${TILES:+--variants "$TILES"} \
    --budget-s $(( ${T_TILES:-300} - 60 ))
# The GPU default (the Triton kernel inside the compiled layers, the forward as one CUDA graph), the same
# launched from Python, then flex_attention outside the layers.
TARGET_VARIANTS=${TARGET_VARIANTS:-trunc-triton-compiled-graph,trunc-triton-compiled,trunc-flex-compiled}
has target && step target_8b "${T_TARGET:-200}" python3 target_forward.py --steps 10 --variants "$TARGET_VARIANTS"
has doctiles && step doc_attn_tiles "${T_DOCTILES:-150}" python3 doc_attn_tiles.py ${DOC_TILES:+--variants "$DOC_TILES"}
has small && step drafter_0p6b "${T_SMALL:-110}" python3 drafter_step.py --preset qwen3_0p6b --modes "$SMALL_MODES" \
    --scope layers --steps 30 --warmup 5
cd ..
if has pipeline; then  # at the preset's defaults (compiled target, GPU turns), then without turns
    # The target alone: this call's `target` part when it ran (its JSON in $OUT), else a run of its own.
    TJ=$(realpath "${PIPE_TARGET_JSON:-$OUT/target_qwen3_8b.json}")  # absolute: pipeline.py runs in bench/
    if ! has target && [ -z "${PIPE_TARGET_JSON:-}" ]; then
        TJ="$PIPE/target_qwen3_8b.json"
        step target_alone 150 env OUT="$PIPE" python3 bench/target_forward.py --variants trunc-triton-compiled-graph --steps 20
    fi
    long_chats "$PIPE/long_chats.jsonl" 600
    for turns in ${PIPE_TURNS:-auto off}; do  # off: the second run finds the first's compiled graphs
        step "pipeline_1p1_turns_$turns" "${T_PIPE:-220}" torchrun --standalone --nproc-per-node 2 -m dflash_mp.main \
            experiment=qwen3_8b target.path=builtin:random-qwen3-8b topology.gpu_turns="$turns" \
            data.path="$PIPE/long_chats.jsonl" train.max_steps="${PIPE_STEPS:-80}" logging.log_every=10 logging.progress=false \
            checkpoint.every=0 checkpoint.overwrite=true run_dir="$PIPE/run_$turns" ${PIPE_ARGS:-}
        cp "$PIPE/run_$turns/tb/drafter/scalars.jsonl" "$OUT/pipe_${turns}_drafter_scalars.jsonl" 2>/dev/null
        cp "$PIPE/run_$turns/tb/target/scalars.jsonl" "$OUT/pipe_${turns}_target_scalars.jsonl" 2>/dev/null
        (cd bench && python3 pipeline.py --target-json "$TJ" --target-variant "${PIPE_TARGET_VARIANT:-trunc-triton-compiled-graph}" \
            --drafter-mode "${PIPE_DRAFTER_MODE:-default+ce=triton}" --skip "${PIPE_SKIP:-20}" \
            --drafter-json "$OUT/drafter_qwen3_8b_layers.json" --run-dir "$PIPE/run_$turns") 2>&1 | tee -a "$LOG"
    done
    has target || [ -n "${PIPE_TARGET_JSON:-}" ] || cp "$PIPE/target_qwen3_8b.json" "$OUT/pipe_target_alone.json" 2>/dev/null
fi
grep -E "^(qwen3_|target forward|target attention, one|flex_attention, one|CE chunk)" -A10 "$LOG" | grep -v "^--" | cut -c1-160
grep -E "GPU ms.* by kernel class|GPU idle|loss match|passed|failed" "$LOG" | cut -c1-300
