#!/usr/bin/env bash
# Every single-GPU figure of BENCHMARKS.md in one device call (from the repo root on the GPU host):
#   bash bench/run_h200.sh            # JSON + logs to $OUT (the lent machine) or bench/results
# Each step has its own time limit so one slow compile cannot lose the others' figures.
set -u
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-$PWD/bench/results}"
export OUT
cd bench
timeout "${T_DRAFTER:-300}" python3 drafter_step.py --preset qwen3_8b --modes eager,default,reduce-overhead \
    --scope "${SCOPE:-layers}" --loss-steps 50 --steps 10 --warmup 3 > "$OUT/drafter_qwen3_8b.log" 2>&1
timeout "${T_SMALL:-120}" python3 drafter_step.py --preset qwen3_0p6b --modes eager,reduce-overhead \
    --scope "${SCOPE:-layers}" --steps 30 --warmup 3 > "$OUT/drafter_qwen3_0p6b.log" 2>&1
timeout "${T_RING:-60}" torchrun --standalone --nproc-per-node 2 ring.py --kind shm > "$OUT/ring.log" 2>&1
for f in drafter_qwen3_8b drafter_qwen3_0p6b ring; do
    echo "== $f"; grep -v -i warn "$OUT/$f.log" | tail -8
done
