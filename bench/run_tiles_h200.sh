#!/usr/bin/env bash
# Larger attention tiles (issue 31, BENCHMARKS.md), one H200, from the repo root:
#   bash bench/run_tiles_h200.sh [PART...]   # PART: tests doc target btiles drafter (default: all)
# 1. the CUDA tests of both attention kernels (the block kernels with one and two blocks a program),
#    while the drafter's and the target's default graphs compile in the background;
# 2. per layer: the target's kernel's tiles against its default (bench/doc_attn_tiles.py; the packed
#    query heads this script swept first were dropped since); the drafter's block kernels with one block
#    a program (triton-single, the previous default) and other tiles of two, against the default (two
#    blocks in the forward and dQ since this sweep, bench/flex_tiles.py's TRITON_VARIANTS);
# 3. the fastest of each sweep (bench/pick_tiles.py) in the whole 8B forward / step, against the default,
#    interleaved (A B A B: the first variant of a process tends to time fastest).
# JSON + the log (tiles.log) go to $OUT (the lent machine) or bench/results.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step
bench_env
LOG="$OUT/tiles.log"
export OUT
t0=$SECONDS
PARTS=${*:-tests doc target btiles drafter}
has() { [[ " $PARTS " == *" $1 "* ]]; }
DOC_TILES=${DOC_TILES:-triton,triton-m64n64w4s3,triton-m64n32w8s3,triton-m128n64w8s3,triton}
B_TILES=${B_TILES:-triton-single,triton,triton-pairq-dq128,triton-pairq-n128,triton-pairq-s2,triton-dq64w8,triton-single,triton}
TV=trunc-triton-compiled-graph
DM=default+ce=triton
cd bench
W=$(mktemp -d)
warm=()  # the timed parts' default graphs compile in the background while the tests run
if has drafter; then
    (TORCHINDUCTOR_COMPILE_THREADS=6 OUT=$W timeout "${T_WARM:-300}" python3 drafter_step.py --preset qwen3_8b \
        --modes $DM --scope layers --steps 1 --warmup 2 > "$W/wd.log" 2>&1) & warm+=($!)
fi
if has target; then
    (TORCHINDUCTOR_COMPILE_THREADS=4 OUT=$W timeout "${T_WARM:-300}" python3 target_forward.py --variants $TV --steps 1 \
        > "$W/wt.log" 2>&1) & warm+=($!)
fi
has tests && step gpu_tests "${T_TESTS:-240}" env TORCHINDUCTOR_COMPILE_THREADS=4 python3 -m pytest -q -rs \
    -p no:cacheprovider ../tests/test_block_attn.py ../tests/test_doc_attn.py ${GPU_TESTS:-}
for j in ${warm[@]+"${warm[@]}"}; do wait "$j"; done
echo "== warm-up done at $((SECONDS - t0)) s: $(tail -qn1 "$W"/*.log 2>/dev/null | cut -c1-80 | tr '\n' ' ')" | tee -a "$LOG"
has doc && step doc_attn_tiles "${T_DOCTILES:-120}" python3 doc_attn_tiles.py --variants "$DOC_TILES"
has btiles && step flex_tiles "${T_TILES:-200}" python3 flex_tiles.py --variants "$B_TILES" \
    --budget-s $(( ${T_TILES:-200} - 40 ))
# The sweeps' picks, or (without them in this call) $DOC / $BT as given.
[ -f "$OUT/doc_attn_tiles.json" ] && DOC=${DOC:-$(python3 pick_tiles.py doc "$OUT/doc_attn_tiles.json")}
[ -f "$OUT/flex_tiles_qwen3_8b.json" ] && BT=${BT:-$(python3 pick_tiles.py drafter "$OUT/flex_tiles_qwen3_8b.json")}
echo "== picked: target @${DOC:-none}, drafter +btiles=${BT:-none}" | tee -a "$LOG"
if has target && [ -n "${DOC:-}" ]; then
    step target_8b "${T_TARGET:-150}" python3 target_forward.py --steps 10 --variants "$TV,$TV@$DOC,$TV,$TV@$DOC"
fi
if has drafter && [ -n "${BT:-}" ]; then
    step drafter_8b "${T_DRAFTER:-200}" python3 drafter_step.py --preset qwen3_8b --scope layers --loss-steps 0 \
        --steps 10 --warmup 3 --modes "${DRAFTER_MODES:-$DM,$DM+btiles=$BT,$DM,$DM+btiles=$BT}"
fi
grep -E "^(qwen3_|target forward|target attention, one|flex_attention, one)" -A12 "$LOG" | grep -v "^--" | cut -c1-170
grep -E "GPU ms.* by kernel class|passed|failed|picked" "$LOG" | cut -c1-300
