#!/usr/bin/env bash
# The CUDA tests (`pytest -m gpu`), one file at a time, each under its own time limit, so that one slow
# file cannot starve the rest of a device call, and every test named with its outcome as it ends (-v):
#   bash bench/run_gpu_tests.sh [FILE...]     # default: every tests/ file with a gpu-marked test
# T_FILE (default 150): seconds per file; T_ALL (default 540): when to stop starting files. Under $OUT
# (or bench/results): gpu_tests.log (pytest's output) and gpu_tests.json; prints a table per file last.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step
bench_env
LOG=$OUT/gpu_tests.log
mkdir -p "$OUT"
t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader >> "$LOG" 2>&1
files=("$@")
[ ${#files[@]} -gt 0 ] || mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
rows=()
for f in "${files[@]}"; do
    if [ $((SECONDS - t0)) -ge "${T_ALL:-540}" ]; then
        rows+=("$f|not started|-")
        continue
    fi
    out=/tmp/gpu_tests_$(basename "$f" .py).log
    t=$SECONDS
    timeout -k 10 "${T_FILE:-150}" python3 -m pytest -v -rfEs -m gpu -p no:cacheprovider "$f" > "$out" 2>&1
    rc=$?
    cat "$out" >> "$LOG"
    summary=$(grep -E "^[=]* *[0-9]+ (passed|failed|skipped|deselected|error)" "$out" | tail -1 | tr -d '=')
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && summary="cut at ${T_FILE:-150} s, $(grep -c ' PASSED' "$out") passed before"
    rows+=("$f|${summary:-rc $rc}|$((SECONDS - t))")
done
printf '%s\n' "${rows[@]}" | python3 -c '
import json, sys
rows = [dict(zip(("file", "outcome", "seconds"), line.rstrip("\n").split("|"))) for line in sys.stdin if line.strip()]
json.dump(rows, open(sys.argv[1], "w"), indent=1)
print("%-40s %5s  %s" % ("file", "s", "outcome"))
for r in rows:
    print("%-40s %5s  %s" % (r["file"], r["seconds"], r["outcome"].strip()))
' "$OUT/gpu_tests.json" | tee -a "$LOG"
grep -E "^(FAILED|ERROR) " "$LOG" | cut -c1-200
echo "== done at $((SECONDS - t0)) s" | tee -a "$LOG"
