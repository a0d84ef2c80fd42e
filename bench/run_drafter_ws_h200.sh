#!/usr/bin/env bash
# One device call: the 8B drafter step with and without a cuBLAS workspace, in alternating processes
# (PyTorch sizes the workspace at a process's first GEMM), then the workspace's and the dump's tests on the GPU
# host. From the repo root:
#   bash bench/run_drafter_ws_h200.sh   (under $OUT: run_drafter_ws.log and drafter_ws_<none|torch><round>.json)
source bench/lib.sh
bench_env
LOG=$OUT/run_drafter_ws.log
t0=$SECONDS
cd bench
for round in 1 2; do
    for ws in none torch; do
        loss=0
        [ "$round" = 1 ] && loss="${LOSS_STEPS:-20}"
        step "drafter $ws $round" "${T_DRAFTER:-200}" env OUT=/tmp/ws_$ws$round python3 drafter_step.py \
            --preset qwen3_8b --modes default+ce=triton --scope layers --steps 10 --warmup 3 \
            --loss-steps "$loss" --loss-mode default+ce=triton --cublas-workspace $ws
        cp /tmp/ws_$ws$round/drafter_qwen3_8b_layers.json "$OUT/drafter_ws_$ws$round.json"
    done
done
cd ..
step tests 150 python3 -m pytest -q -rfs tests/test_blas.py tests/test_dump.py
grep -A 3 "^qwen3_8b on\|GPU ms/step by kernel class\|GPU idle" "$LOG" | cut -c1-220
