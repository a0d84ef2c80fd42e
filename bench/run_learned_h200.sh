#!/usr/bin/env bash
# The GPU learning proof (issue 3) in one device call, from the repo root on the GPU host:
#   bash bench/run_learned_h200.sh     # logs + JSON to $OUT/results.tgz (or bench/results/learned_h200/)
# 1. the CUDA-only tests, in the background while the medium target trains (neither is timed);
# 2. `python -m dflash_mp.builtin.proof proof.size=medium` on a quiet GPU: regenerate -> torchrun 1+1
#    -> evaluate (held-out tau_sim, live tau at B=16, lossless check, speedup; trained and untrained);
# 3. the target forward at Qwen3-8B shapes, eager and compiled flex, with a kernel-class profile.
OUT="${OUT:-$PWD/bench/results/learned_h200}"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env
bench_env
export DFLASH_MP_CACHE="${DFLASH_MP_CACHE:-/tmp/dflash_mp_cache}"
R=$(mktemp -d)
WORK=${WORK:-/tmp/learned_medium}
LIMIT=${LIMIT:-570}  # seconds for the whole script (the device call allows 600)
t0=$SECONDS
say() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$R/call.log"; }
(OUT="$R" bash bench/run_h200.sh tests > /dev/null) &  # the CUDA-only tests, as run_h200.sh runs them
tests=$!
timeout 200 python3 -m dflash_mp.builtin build-learned build_learned.size=medium > "$R/build_target.log" 2>&1
say "build-target rc $?"
wait $tests
say "gpu tests: $(grep -E "passed|failed" "$R/run_h200.log" | tail -1)"
timeout 330 python3 -m dflash_mp.builtin.proof proof.work="$WORK" proof.size=medium > "$R/pipeline.log" 2>&1
say "pipeline rc $?"
cp "$WORK"/reports.json "$WORK"/eval_*.json "$R/" 2>/dev/null
cp "$WORK/run/tb/drafter/scalars.jsonl" "$R/learned_medium_drafter_scalars.jsonl" 2>/dev/null
left=$((LIMIT - (SECONDS - t0) - 15))
if [ "$left" -gt 60 ]; then
    OUT="$R" T_TARGET=$left TARGET_VARIANTS=trunc-flex,trunc-flex-compiled bash bench/run_h200.sh target > /dev/null
    say "target forward done"
fi
mkdir -p "$OUT" && tar czf "$OUT/results.tgz" -C "$R" .
tail -4 "$R/pipeline.log"
grep -A4 "^target forward" "$R/run_h200.log"
