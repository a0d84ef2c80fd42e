# Shared by the bench/run_*.sh scripts (source it after setting LOG and t0=$SECONDS).
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
