#!/usr/bin/env bash
# The drafter step at its defaults against variants of it, in one device call at the 8B drafter's shapes:
#   1. the block kernels' CUDA tests (against dense attention: eager and compiled, descriptors and pointers),
#      or the pytest arguments in $TESTS;
#   2. the drafter step (bench/drafter_step.py), in one process: the default, then each of $VARIANTS (its
#      `+flag` suffixes), $RUNS times over, and with LOSS_STEPS > 0 the default's compiled-against-eager losses.
# VARIANTS is required: e.g. VARIANTS=+masked,+btiles=triton-pairq-n128 (call K2 compared dK/dV in parts, at
# commit 8b20360: VARIANTS=+btiles=triton-dkv2,+btiles=triton-dkv2s3,+btiles=triton-dkv4s3).
# From the repo root:  VARIANTS=... bash bench/run_modes_h200.sh   (under $OUT: run_modes.log, modes.json,
# modes_drafter.json). Prints a table last.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step
bench_env
: "${VARIANTS:?set VARIANTS to the +flag suffixes to compare with the default, comma-separated}"
LOG=$OUT/run_modes.log
mkdir -p "$OUT"
t0=$SECONDS
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
# shellcheck disable=SC2086  # TESTS: pytest's arguments, split on spaces
step tests "${T_TESTS:-150}" python3 -m pytest -q -rfs ${TESTS:-tests/test_block_attn.py -k cuda}
modes=$(for _ in $(seq "${RUNS:-2}"); do
    printf "default+ce=triton,"
    for v in ${VARIANTS//,/ }; do printf "default+ce=triton%s," "$v"; done
done | sed 's/,$//')
cd bench
step drafter "${T_DRAFTER:-290}" env OUT=/tmp/modes_drafter python3 drafter_step.py --preset qwen3_8b \
    --modes "$modes" --scope layers --steps 10 --warmup 3 --loss-steps "${LOSS_STEPS:-0}" --loss-mode default+ce=triton
cp /tmp/modes_drafter/drafter_qwen3_8b_layers.json "$OUT/modes_drafter.json"
python3 modes_table.py "$OUT/modes_drafter.json" --out "$OUT/modes.json" | tee -a "$LOG"
echo "== done at $((SECONDS - t0)) s" | tee -a "$LOG"
