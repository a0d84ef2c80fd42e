# Environment every launcher sets (sourced by single_node.sh, multi_node.sh, slurm.sbatch); a value
# already in the environment wins.
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
# Compiled kernels persist across runs: a cold start spends ~4 min compiling (BENCHMARKS.md).
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/dflash_mp/inductor}"
