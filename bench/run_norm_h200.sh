#!/usr/bin/env bash
# One device call: the drafter's RMSNorm backward in one pass (train.norm_kernel=triton, the default) against
# Inductor's (autograd), alone and in the 8B step, interleaved; whether the AdamW update could hide under the
# next forward's matmuls (bench/adamw_overlap.py). From the repo root:
#   bash bench/run_norm_h200.sh        (logs and JSON under $OUT: run_norm.log, norm_bwd.json, adamw_overlap.json,
#                                       drafter_qwen3_8b_layers.json)
source bench/lib.sh
bench_env
LOG=$OUT/run_norm.log
t0=$SECONDS
step tests 150 python3 -m pytest -q -rfs tests/test_rms_norm.py
cd bench
step norm 150 python3 norm_bwd.py
step overlap 180 python3 adamw_overlap.py
MODES=default+ce=triton,default+ce=triton+norm=autograd,default+ce=triton,default+ce=triton+norm=autograd
step drafter "${T_DRAFTER:-330}" python3 drafter_step.py --preset qwen3_8b --modes "$MODES" --scope layers \
    --steps 10 --warmup 3 --loss-steps "${LOSS_STEPS:-30}" --loss-mode default+ce=triton
grep -A 12 "^| norm" "$LOG"
grep -B 2 -A 14 "^| variant" "$LOG"
grep -A 12 "^qwen3_8b on" "$LOG" | cut -c1-200
