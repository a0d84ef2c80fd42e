#!/usr/bin/env bash
# The GPU learning proof (issue 3) in one device call, from the repo root on the GPU host:
#   bash bench/run_learned_h200.sh     # logs + JSON to $OUT/results.tgz (or bench/results/learned_h200/)
# 1. the CUDA-only tests, in the background while the medium target trains (neither is timed);
# 2. `python -m dflash_mp.learned pipeline --size medium` on a quiet GPU: regenerate -> torchrun 1+1
#    -> evaluate (held-out tau_sim, live tau at B=16, lossless check, speedup; trained and untrained);
# 3. the target forward at Qwen3-8B shapes, eager and compiled flex, with a kernel-class profile.
set -u
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" PYTHONUNBUFFERED=1
export DFLASH_MP_CACHE="${DFLASH_MP_CACHE:-/tmp/dflash_mp_cache}"
OUT="${OUT:-$PWD/bench/results/learned_h200}"
R=$(mktemp -d)
WORK=${WORK:-/tmp/learned_medium}
LIMIT=${LIMIT:-570}  # seconds for the whole script (the device call allows 600)
t0=$SECONDS
say() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$R/call.log"; }
(timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_trainer_compile.py \
    tests/test_transport_shm.py::test_cuda_stream \
    tests/test_drafter.py::test_flex_matches_dense_on_cuda_and_compiled_step_never_recompiles \
    > "$R/gpu_tests.log" 2>&1; echo "rc $?" >> "$R/gpu_tests.log") &
tests=$!
timeout 200 python3 -m dflash_mp.learned build-target --size medium > "$R/build_target.log" 2>&1
say "build-target rc $?"
wait $tests
say "gpu tests: $(tail -2 "$R/gpu_tests.log" | tr '\n' ' ')"
timeout 330 python3 -m dflash_mp.learned pipeline --work "$WORK" --size medium > "$R/pipeline.log" 2>&1
say "pipeline rc $?"
cp "$WORK"/reports.json "$WORK"/eval_*.json "$R/" 2>/dev/null
cp "$WORK/run/tb/drafter/scalars.jsonl" "$R/learned_medium_drafter_scalars.jsonl" 2>/dev/null
left=$((LIMIT - (SECONDS - t0) - 15))
if [ "$left" -gt 60 ]; then
    (cd bench && OUT="$R" timeout "$left" python3 target_forward.py --variants trunc-flex,trunc-flex-compiled \
        --steps 10 > "$R/target_forward.log" 2>&1)
    say "target forward rc $?"
fi
mkdir -p "$OUT" && tar czf "$OUT/results.tgz" -C "$R" .
tail -4 "$R/pipeline.log"
tail -8 "$R/target_forward.log" 2>/dev/null
