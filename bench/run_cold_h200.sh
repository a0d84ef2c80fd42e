#!/usr/bin/env bash
# Start-up on a cold H200 (issue 29): where the drafter's first step goes, and what a restart from
# the saved compile artifacts still compiles.
#   bash bench/run_cold_h200.sh [PART...]     # PART: masks restart (default: both)
#   masks    bench/cold_start.py masks: our BlockMask builder, then (beside the rest, in the background,
#            bounded by $T_TORCH_MASKS) torch.compile(create_block_mask), from empty caches
#   restart  bench/cold_start.py step --preset $PRESET: a cold drafter (empty Inductor and Triton
#            caches) saves its artifacts; a second process with new empty caches loads them
# Every Triton compile is timed (bench/triton_timer). Results under $OUT (or bench/results):
# run_cold.log, cold_*.json, triton_*.jsonl. Wheels: ../shared/device/prepare.sh, carry .whl.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step
bench_env
export PYTHONPATH="$PYTHONPATH:$PWD/bench/triton_timer"
W=${W:-/root/cold_work}
LOG="$OUT/run_cold.log"
PARTS=${*:-masks restart}
PRESET=${PRESET:-qwen3_8b}
mkdir -p "$W" "$OUT"
t0=$SECONDS
has() { [[ " $PARTS " == *" $1 "* ]]; }
fresh() {  # fresh NAME: empty Inductor and Triton caches, and this stage's Triton compile log
    export TORCHINDUCTOR_CACHE_DIR="$W/inductor_$1" TRITON_CACHE_DIR="$W/triton_$1" DFLASH_TRITON_LOG="$OUT/triton_$1.jsonl"
    rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
}
nproc >> "$LOG"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$LOG"
cd bench
bg=()
if has masks; then
    fresh masks
    step masks_ours 120 python3 cold_start.py masks --preset qwen3_5_27b --builders ours
    (fresh masks_torch; step masks_torch "${T_TORCH_MASKS:-200}" python3 cold_start.py masks --preset qwen3_5_27b \
        --builders torch --tag _torch) & bg+=($!)
fi
if has restart; then
    fresh cold
    step cold "${T_COLD:-330}" python3 cold_start.py step --preset "$PRESET" --save "$W/artifacts.bin" --tag _cold
    fresh restart
    step restart "${T_RESTART:-150}" python3 cold_start.py step --preset "$PRESET" --load "$W/artifacts.bin" --tag _restart
fi
for j in "${bg[@]}"; do wait "$j"; done
grep -E '^\{"builder"|^== ' "$LOG" | cut -c1-260
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/cold_step_*.json")):
    d = json.load(open(f))
    print(f.split("/")[-1], "loaded", d["loaded_artifacts"], "steps s", d["step_s"], "mask s", d["first_mask_build_s"])
    print("  caches", d["caches"])
    print("  phases", d["compile_phases_s"])
    t = d.get("triton") or {}
    print("  triton", {k: t.get(k) for k in ("count", "seconds_summed", "over_1s", "processes")})
    for name, s in t.get("slowest", [])[:10]:
        print(f"    {s:7.1f} s  {name}")
PY
