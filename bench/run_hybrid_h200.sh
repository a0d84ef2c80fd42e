#!/usr/bin/env bash
# Hybrid (Qwen3.5) and MoE targets on one H200, at the presets' defaults (no target.* override):
#   bash bench/run_hybrid_h200.sh [PART...]   # PART: tests job27 targets job35 (default: tests job27)
#   tests    the CUDA tests of the hybrid path (tests/test_hybrid_gpu.py), beside job27 (little memory)
#   job27    experiment=qwen3_5_27b on builtin:random-qwen3.5-27b, 1 target + 1 drafter sharing the GPU
#            (what num_target_ranks=auto picks for 2 processes), compiled as by default, from the
#            Inductor cache as found (empty on a fresh machine: the cold start is part of the figure);
#            $JOB27_ARGS adds overrides (train.compile=eager: a drafter that compiles nothing), $JOB27_NAME
#            names its run directory (job27)
#   targets  bench/hybrid_targets.py: each hybrid/MoE target loaded as the job does, timed ($TARGETS)
#   job35    builtin:random-qwen3.5-35b-a3b under the 27B preset's drafter (its MLP width set: the MoE
#            has no dense width to copy), 1 + 1 on the GPU ($JOB35_ARGS adds overrides)
# Results under $OUT (the lent machine) or bench/results: run_hybrid.log, hybrid_targets.json, and
# hybrid_runs.tgz (each job's rank logs and scalars). Wheels: ../shared/device/prepare.sh, carry .whl.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step, long_chats
bench_env
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/root/hybrid_inductor}  # kept while the machine is
W=${W:-/root/hybrid_work}
LOG="$OUT/run_hybrid.log"
PARTS=${*:-tests job27}
mkdir -p "$W" "$OUT"
t0=$SECONDS
has() { [[ " $PARTS " == *" $1 "* ]]; }
job() {  # job NAME SECONDS OVERRIDES...: the training job, 1 target + 1 drafter on the GPU
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" torchrun --standalone --nproc-per-node 2 -m dflash_mp.main \
        data.path="$W/long_chats.jsonl" logging.log_every=10 logging.progress=false checkpoint.every=0 \
        checkpoint.overwrite=true run_dir="$W/$name" "$@"
    grep -hE "packs exactly|attention|first step|recompile|samples/s|step +[0-9]+ " "$W/$name"/logs/rank_*.log \
        2>/dev/null | cut -c1-220 | tail -40 >> "$LOG"
}
long_chats "$W/long_chats.jsonl" 400
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$LOG"
python3 -c "import fla, torch, transformers, triton; print('fla', fla.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__, 'triton', triton.__version__)" >> "$LOG" 2>&1
bg=()
if has job27; then
    (job "${JOB27_NAME:-job27}" "${T_JOB27:-540}" experiment=qwen3_5_27b target.path=builtin:random-qwen3.5-27b \
        topology.num_target_ranks=auto train.max_steps="${STEPS27:-120}" ${JOB27_ARGS:-}) & bg+=($!)
fi
if has tests; then
    sleep 5  # the job's target claims its memory first
    step gpu_tests "${T_TESTS:-300}" python3 -m pytest -q -rs -s -p no:cacheprovider -m gpu tests/test_hybrid_gpu.py
fi
for j in "${bg[@]}"; do wait "$j"; done
# rows/s over steps 20 on, against the 27B's limit on one H200 (BENCHMARKS.md), into jobs27.json
has job27 && (cd bench && python3 pipeline.py --skip 20 --jobs "$W/${JOB27_NAME:-job27}" --limit 2.96 --json jobs27.json) \
    2>&1 | tee -a "$LOG"
has targets && step targets "${T_TARGETS:-420}" python3 bench/hybrid_targets.py ${TARGETS:+--targets "$TARGETS"}
has job35 && job job35 "${T_JOB35:-420}" experiment=qwen3_5_27b target.path=builtin:random-qwen3.5-35b-a3b \
    drafter.intermediate_size=6144 train.max_steps="${STEPS35:-120}" ${JOB35_ARGS:-}
tar czf "$OUT/hybrid_runs.tgz" -C "$W" --exclude='*.pt' --exclude='checkpoints' --exclude='compile_cache' --exclude='export' \
    $(cd "$W" && ls -d job* 2>/dev/null) 2>/dev/null
grep -E "^== |passed|failed|varlen vs|compiled vs|packing check, per|flex \(reg" "$LOG" | cut -c1-240
grep -E "^target \||^builtin:" "$LOG"
