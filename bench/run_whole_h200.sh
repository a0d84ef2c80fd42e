#!/usr/bin/env bash
# The block kernels' whole tiles (block_attn.WHOLE_TILES: the forward's key tiles every row of a program sees
# whole skip the mask; in call J1 dQ's and dK/dV's too) against every tile masked, in one device call, at the
# 8B drafter's shapes:
#   1. the block kernels' CUDA tests (against dense attention: eager and compiled, descriptors and pointers;
#      call J1 ran the whole file, the interpreter tests too, and ran out of its 150 s);
#   2. one drafter layer's attention alone (bench/flex_tiles.py): triton and triton-masked, alternating, twice,
#      then with whole tiles the forward over 128-key tiles (triton-pairq-n128), dQ over 128 (triton-pairq-dq128)
#      and dK/dV over 64-row tiles with 8 warps (triton-n2x64w8);
#   3. the drafter step (bench/drafter_step.py): the default and +masked alternating, $RUNS each, in one
#      process, and the default's compiled-against-eager losses over $LOSS_STEPS steps.
# Call J2: LAYER_VARIANTS= LOSS_STEPS=0 (the device time left).
# From the repo root:  bash bench/run_whole_h200.sh   (under $OUT: run_whole.log, whole.json, the parts' JSON)
# Prints a table last.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step
bench_env
LOG=$OUT/run_whole.log
mkdir -p "$OUT"
t0=$SECONDS
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
step tests 150 python3 -m pytest -q -rfs tests/test_block_attn.py -k cuda
cd bench
LAYER_VARIANTS=${LAYER_VARIANTS-triton,triton-masked,triton,triton-masked,triton-pairq-n128,triton-pairq-dq128,triton-n2x64w8}
if [ -n "$LAYER_VARIANTS" ]; then  # LAYER_VARIANTS= skips the layer bench
    step layer 90 env OUT=/tmp/whole_layer python3 flex_tiles.py --preset qwen3_8b --variants "$LAYER_VARIANTS"
    cp /tmp/whole_layer/flex_tiles_qwen3_8b.json "$OUT/whole_layer.json"
fi
modes=$(for _ in $(seq "${RUNS:-2}"); do printf "default+ce=triton,default+ce=triton+masked,"; done | sed 's/,$//')
step drafter "${T_DRAFTER:-290}" env OUT=/tmp/whole_drafter python3 drafter_step.py --preset qwen3_8b \
    --modes "$modes" --scope layers --steps 10 --warmup 3 --loss-steps "${LOSS_STEPS:-20}" --loss-mode default+ce=triton
cp /tmp/whole_drafter/drafter_qwen3_8b_layers.json "$OUT/whole_drafter.json"
cd ..
python3 - "$OUT" <<'EOF' | tee -a "$LOG"
import json, os, sys
sys.path.insert(0, "bench")
from modes_table import drafter_rows, load, print_rows
out = sys.argv[1]
layer, drafter = load(os.path.join(out, "whole_layer.json")), load(os.path.join(out, "whole_drafter.json"))
rows = []
for v in layer.get("variants", []):
    if "fwd_ms" in v:
        rows.append(("layer " + v["variant"], f"fwd {v['fwd_ms']:.3f} bwd {v['bwd_ms']:.3f} ms",
                     f"rel diff {v['max_rel_diff_vs_first']}"))
    else:
        rows.append(("layer " + v["variant"], v.get("error", "?")[:60], ""))
rows += drafter_rows(drafter)
summary = {"device": drafter.get("device"), "torch": drafter.get("torch"), "rows": rows}
with open(os.path.join(out, "whole.json"), "w") as f:
    json.dump(summary, f, indent=1)
print_rows(summary["device"], summary["torch"], rows)
EOF
echo "== done at $((SECONDS - t0)) s" | tee -a "$LOG"
