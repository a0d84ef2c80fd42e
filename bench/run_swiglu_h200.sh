#!/usr/bin/env bash
# The SwiGLU with its gate and up projections in one Triton GEMM (swiglu.py), in one device call at the
# 8B target's and drafter's shapes:
#   1. its CUDA tests (tests/test_swiglu.py -m gpu: the kernel in bf16, a tiny target compiled through it and
#      replayed, the training form's gradients eager and compiled);
#   2. the kernel alone against cuBLAS's two GEMMs and Inductor's SwiGLU (bench/swiglu_gemm.py), over its tiles,
#      then at the drafter's 8192 rows (the default tiles and their persistent form, each also writing the
#      projections, as a training forward would), and the training backward's GEMM there (`--backward`);
#   3. the 8B target forward, the default against `-swiglu`, alternating, $RUNS times each (bench/target_forward.py).
# From the repo root:  bash bench/run_swiglu_h200.sh   (under $OUT: run_swiglu.log, swiglu_gemm.json,
# swiglu_gemm_m8192.json, swiglu_bwd_m8192.json, swiglu_target.json). Prints the forward's table last.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step
bench_env
LOG=$OUT/run_swiglu.log
mkdir -p "$OUT"
t0=$SECONDS
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
step tests "${T_TESTS:-120}" python3 -m pytest -q -rfs -m gpu tests/test_swiglu.py
cd bench
step kernel "${T_KERNEL:-150}" python3 swiglu_gemm.py
# The drafter's MLP rows (512 anchors x 16 = 8192 at the 8B preset): would the kernel keep cuBLAS's pace there?
step kernel_m8192 "${T_KERNEL_M8192:-60}" env OUT=/tmp/swiglu_m8192 python3 swiglu_gemm.py --rows 8192 \
    --tiles "128,128,64,8,8,4,0;128,128,64,8,8,4,1" --gate-up
cp /tmp/swiglu_m8192/swiglu_gemm.json "$OUT/swiglu_gemm_m8192.json" 2>/dev/null
step kernel_bwd "${T_KERNEL_BWD:-60}" env OUT=/tmp/swiglu_bwd python3 swiglu_gemm.py --rows 8192 --backward
cp /tmp/swiglu_bwd/swiglu_bwd.json "$OUT/swiglu_bwd_m8192.json" 2>/dev/null
grep -A14 ", M=[0-9]* K=" "$LOG"
variants=$(for _ in $(seq "${RUNS:-2}"); do printf "trunc-triton-compiled-graph,trunc-triton-compiled-swiglu-graph,"; done)
step target "${T_TARGET:-240}" env OUT=/tmp/swiglu_target python3 target_forward.py --steps 10 --variants "${variants%,}"
cp /tmp/swiglu_target/target_qwen3_8b.json "$OUT/swiglu_target.json"
sed -n '/^target forward, T=/,$p' "$LOG" | head -12
echo "== done at $((SECONDS - t0)) s" | tee -a "$LOG"
