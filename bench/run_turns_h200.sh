#!/usr/bin/env bash
# One device call: the 8B job at defaults on a bare machine (a cold start, GPU turns), then the drafter step
# (default tiles against the single-block tiles, interleaved) and the job again, warm. From the repo root:
#   bash bench/run_turns_h200.sh        (JSON, logs and scalars under $OUT; the ranks' logs in turns_runs.tgz)
set -u
OUT="${OUT:-$PWD/bench/results}"; export OUT
cp bench/results/drafter_qwen3_8b_pair_call3.json $OUT/drafter_qwen3_8b_layers.json
TJ=bench/results/target_qwen3_8b_pack_call1.json
PIPE_TARGET_JSON=$TJ PIPE_TURNS=auto PIPE_STEPS=60 T_PIPE=230 bash bench/run_h200.sh pipeline
for f in $OUT/pipe_auto_*scalars.jsonl $OUT/pipeline_1gpu.json; do mv $f $(dirname $f)/cold_$(basename $f); done
mv $OUT/run_h200.log $OUT/cold_job.log
DRAFTER_MODES=default+ce=triton,default+ce=triton+btiles=triton-single,default+ce=triton,default+ce=triton+btiles=triton-single LOSS_STEPS=0 T_DRAFTER=230 PIPE=/tmp/dflash_pipe2 PIPE_TARGET_JSON=$TJ PIPE_TURNS=auto PIPE_STEPS=60 T_PIPE=170 bash bench/run_h200.sh drafter pipeline
tar czf $OUT/turns_runs.tgz -C /tmp dflash_pipe/run_auto/logs dflash_pipe2/run_auto/logs $(cd /tmp && ls dflash_pipe*/run_auto/tb/*/scalars.jsonl)  # the device returns at most 8 files
python3 bench/scalars_table.py /tmp/dflash_pipe/run_auto 2>&1 | tail -15
python3 bench/scalars_table.py /tmp/dflash_pipe2/run_auto 2>&1 | tail -15
