#!/usr/bin/env bash
# Does a shared-GPU job refill an emptied ring? The 8B job at defaults (1 target + 1 drafter, GPU turns),
# its target paused 1 s at step $STALL_STEP (DFLASH_MP_FAULT=0:<step>:stall), 60 steps logged every 10:
# the intervals after the pause show whether the drafter still waits a forward for each batch, and
# stall_<run>_<variant>.json the rows/s after the interval that holds it ($PIPE_SKIP: from step 30).
# $BEFORE_SRC: a src/ tree of other code (beside its own conf/) to run the same job with, interleaved
# (now before now before; $VARIANTS sets the order). From the repo root, results under $OUT:
#   BEFORE_SRC=/tmp/before/src bash bench/run_stall_h200.sh
set -u
OUT="${OUT:-$PWD/bench/results}"; export OUT
STALL_STEP=${STALL_STEP:-25}
[ -f "$OUT/drafter_qwen3_8b_layers.json" ] || cp bench/results/drafter_qwen3_8b_turns_call6.json "$OUT/drafter_qwen3_8b_layers.json"
TJ=bench/results/target_qwen3_8b_pack_call1.json
base=$PYTHONPATH
variants=${VARIANTS:-"now${BEFORE_SRC:+ before} now${BEFORE_SRC:+ before}"}  # in this order
i=0
for v in $variants; do
    i=$((i + 1))
    src=$PWD/src; [ "$v" = before ] && src=$BEFORE_SRC
    PYTHONPATH=$src:$base DFLASH_MP_FAULT=0:$STALL_STEP:stall PIPE=/tmp/dflash_stall_$i PIPE_TARGET_JSON=$TJ PIPE_TURNS=auto \
        PIPE_SKIP=${PIPE_SKIP:-30} PIPE_STEPS=60 T_PIPE=${T_PIPE:-200} bash bench/run_h200.sh pipeline > /dev/null
    mv "$OUT/pipeline_1gpu.json" "$OUT/stall_${i}_$v.json"
    echo "== run $i ($v): $(grep -c 'FAULT stall' /tmp/dflash_stall_$i/run_auto/logs/rank_0.log) stall(s) logged"
    python3 bench/scalars_table.py /tmp/dflash_stall_$i/run_auto | grep -v median
done
tar czf "$OUT/stall_runs.tgz" -C /tmp $(cd /tmp && ls -d dflash_stall_*/run_auto/logs dflash_stall_*/run_auto/tb/*/scalars.jsonl)
mv "$OUT/run_h200.log" "$OUT/stall_run_h200.log"
rm -f "$OUT"/pipe_auto_*_scalars.jsonl  # in the tgz; the device returns at most 8 files
