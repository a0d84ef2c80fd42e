# Shared by the bench/run_*.sh scripts. Source it first; bench_env, then set LOG and t0=$SECONDS before
# the first step.
# bench_env: the environment the GPU scripts run in: unset variables are errors, the checkout's src/ on
# PYTHONPATH, NVLink multicast off (NCCL, symmetric memory, NVSHMEM), OUT defaulting to bench/results.
bench_env() {
    set -u
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" PYTHONUNBUFFERED=1
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    OUT="${OUT:-$PWD/bench/results}"
}
# step NAME SECONDS CMD...: run CMD with a time limit, its output appended to $LOG, and say how it ended.
# A command still running 30 s after its SIGTERM is killed (a job writing its final checkpoint gets them).
step() {
    local name=$1 limit=$2 t=$SECONDS
    shift 2
    echo "== $name" >> "$LOG"
    timeout -k 30 "$limit" "$@" >> "$LOG" 2>&1
    STEP_RC=$?
    echo "== $name rc $STEP_RC in $((SECONDS - t)) s (at $((SECONDS - t0)) s)" | tee -a "$LOG"
}
# long_chats FILE NUM: the benches' long chat data (NUM conversations of 48 turns, seed 1) into FILE,
# unless FILE is there already.
long_chats() {
    [ -f "$1" ] || python3 -m dflash_mp.builtin make-data make_data.out="$1" make_data.num="$2" make_data.turns=48 \
        make_data.seed=1 >> "$LOG" 2>&1
}
