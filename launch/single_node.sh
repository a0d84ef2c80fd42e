#!/usr/bin/env bash
# One node, all its GPUs: target ranks + drafter ranks of dflash_mp.
#   launch/single_node.sh experiment=qwen3_8b data.path=/data/regen.jsonl topology.num_target_ranks=3
# NPROC overrides the process count (default: the number of visible GPUs).
set -euo pipefail
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
# Compiled kernels persist across runs: a cold start spends ~4 min compiling (BENCHMARKS.md).
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/dflash_mp/inductor}"
NPROC="${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
[ "$NPROC" -ge 2 ] || NPROC=2
exec torchrun --standalone --nproc-per-node "$NPROC" -m dflash_mp.main "$@"
