#!/usr/bin/env bash
# The 8B target's projections run fused (TargetWorker's fuse_projections: q/k/v as one GEMM, gate/up as
# one) against apart, on one H200, at the presets' defaults otherwise:
#   bash bench/run_fuse_h200.sh [PART...]   # PART: gemm forward tests (default: all three)
#   gemm     bench/gemm_rows.py: one 8B layer's GEMMs at M = $GEMM_ROWS, apart and fused
#   forward  bench/target_forward.py: the job's forward (one CUDA graph) fused and apart, interleaved twice
#   tests    the CUDA tests of the target's forward ($GPU_TESTS)
# Prints the tables last; writes run_fuse.log, gemm_rows.json and target_qwen3_8b.json under $OUT (or
# bench/results). Wheels: ../shared/device/prepare.sh, carry .whl.
set -u
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/bench/results}"
LOG="$OUT/run_fuse.log"
PARTS=${*:-gemm forward tests}
mkdir -p "$OUT"
t0=$SECONDS
has() { [[ " $PARTS " == *" $1 "* ]]; }
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # step
V=trunc-triton-compiled-fuse-graph
NV=trunc-triton-compiled-nofuse-graph
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv >> "$LOG"
has gemm && (cd bench && step gemm "${T_GEMM:-90}" python3 gemm_rows.py --rows "${GEMM_ROWS:-3072,6144,8192}")
has forward && (cd bench && step forward "${T_FORWARD:-300}" python3 target_forward.py --steps "${STEPS:-10}" \
    --variants "$V,$NV,$V,$NV")
has tests && step gpu_tests "${T_TESTS:-200}" python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
    ${GPU_TESTS:-tests/test_target_graph.py tests/test_doc_attn.py}
echo "== tables" | tee -a "$LOG"
grep -A4 "^rows  |" "$LOG" | tee -a "$LOG.tables"
grep -E "^(variant|trunc-)" "$LOG" | grep -v "GPU ms" | tee -a "$LOG.tables"
grep -E "passed|failed" "$LOG" | tail -3 | tee -a "$LOG.tables"
echo "== done at $((SECONDS - t0)) s"
