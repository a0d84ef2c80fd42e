"""Per-interval throughput of a run directory's roles (its TensorBoard scalars), one line per logged
step, and the medians after warm-up:  python bench/scalars_table.py RUN_DIR [RUN_DIR...]"""

import json
import sys

KEYS = ("throughput/samples_per_s", "throughput/tokens_per_s", "throughput/mfu", "comm/wait_ms",
        "target/tokens_per_s", "target/mfu", "comm/stall_ms", "comm/in_flight", "time/startup_s")


def main() -> None:
    for d in sys.argv[1:]:
        for role in ("drafter", "target"):
            try:
                rows = [json.loads(line) for line in open(f"{d}/tb/{role}/scalars.jsonl")]
            except OSError:
                print(d, role, "no scalars")
                continue
            for r in rows:
                print(d.rstrip("/").split("/")[-1], role, r["step"],
                      " ".join(f"{k.split('/')[-1]}={r[k]:.3g}" for k in KEYS if k in r))
            late = rows[2:] or rows
            for k in KEYS[:-1]:
                vals = sorted(r[k] for r in late if k in r)
                if vals:
                    print(f"  {role} median {k} after the first 2 intervals: {vals[len(vals) // 2]:.4g} "
                          f"(min {vals[0]:.4g}, max {vals[-1]:.4g}, {len(vals)} intervals)")


if __name__ == "__main__":
    main()
