#!/usr/bin/env bash
# One node, all its GPUs: target ranks + drafter ranks of dflash_mp.
#   launch/single_node.sh experiment=qwen3_8b data.path=/data/regen.jsonl topology.num_target_ranks=3
# NPROC overrides the process count (default: the number of visible GPUs).
set -euo pipefail
source "$(dirname "$0")/env.sh"
NPROC="${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
[ "$NPROC" -ge 2 ] || NPROC=2
run_agent torchrun --standalone --nproc-per-node "$NPROC" -m dflash_mp.main "$@"
