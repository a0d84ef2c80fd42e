# Environment every launcher sets (sourced by single_node.sh, multi_node.sh, slurm.sbatch); a value
# already in the environment wins.
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
# Compiled kernels persist across runs (a cold 8B job's first step: ~70 s on an H200, BENCHMARKS.md).
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/dflash_mp/inductor}"

# Run the torchrun agent in a session of its own and pass SIGTERM / SIGINT (a scheduler's stop,
# Ctrl-C) to its workers instead: they agree on a stop step, write a checkpoint and exit 0, so the
# agent and this script exit 0. torchrun signalled itself tears its workers down and exits 1.
run_agent() {
    setsid "$@" &
    local agent=$! rc
    stop_workers() { pkill -TERM -P "$agent" 2>/dev/null || kill -TERM "$agent" 2>/dev/null; }
    trap stop_workers TERM INT
    while true; do
        wait "$agent" && rc=0 || rc=$?  # (set -e must not end the script on an interrupted wait)
        kill -0 "$agent" 2>/dev/null || return "$rc"  # a trapped signal ends `wait` early: wait again
    done
}
