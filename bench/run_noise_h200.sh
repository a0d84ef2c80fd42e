#!/usr/bin/env bash
# The learning proof with and without feature noise (issue 30, item 3) on one H200:
#   bash bench/run_noise_h200.sh     # logs and reports under $OUT (or bench/results/noise)
# The medium learned target is built once, then `python -m dflash_mp.builtin.proof proof.size=medium`
# runs twice at once, train.feature_noise=none and =uniform (default scale), each regenerating its data
# (greedy: the same rows), training a drafter 1+1 and evaluating it (held-out tau_sim, live tau). The
# two share the GPU, so their timings are not figures; their acceptance is.
OUT="${OUT:-$PWD/bench/results/noise}"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env
bench_env
export DFLASH_MP_CACHE="${DFLASH_MP_CACHE:-/tmp/dflash_mp_cache}"
mkdir -p "$OUT"
t0=$SECONDS
timeout "${T_BUILD:-150}" python3 -m dflash_mp.builtin build-learned build_learned.size=medium > "$OUT/build_target.log" 2>&1
echo "[$((SECONDS - t0)) s] build-learned rc $?"
for n in none uniform; do
    timeout "${T_PROOF:-300}" python3 -m dflash_mp.builtin.proof proof.work="/tmp/noise_$n" proof.size=medium \
        train.feature_noise=$n > "$OUT/proof_$n.log" 2>&1 &
done
wait
for n in none uniform; do
    cp "/tmp/noise_$n/reports.json" "$OUT/reports_$n.json" 2>/dev/null
    echo "[$((SECONDS - t0)) s] feature_noise=$n"; grep -E "timings|tau_sim" "$OUT/proof_$n.log" | tail -3
done
