"""The drafter step's modes from one bench/drafter_step.py JSON, a row each: the step, its block attention by
kernel, its matmuls, its recompiles; and the compiled-against-eager losses where the run measured them.

    python bench/modes_table.py DRAFTER_JSON [--out SUMMARY_JSON]
"""

from __future__ import annotations

import argparse
import json


def load(path: str) -> dict:
    """The JSON at `path`, {} where the run left none (a step that ran out of time)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def drafter_rows(drafter: dict) -> list[tuple[str, str, str]]:
    """(mode, step, where its time went) for each mode of a drafter_step.py result."""
    rows = []
    for m in drafter.get("modes", []):
        if "ms_per_step" not in m:
            rows.append((m["mode"], m.get("error", "?")[:60], ""))
            continue
        ks = {k["name"]: k["ms"] for k in m["profile"]["top_kernels"] if k["name"].startswith("block_attn")}
        cls = m["profile"]["ms_per_step_by_class"]
        busy = m["profile"].get("idle", {}).get("busy_ms", float("nan"))
        rows.append((m["mode"], f"{m['ms_per_step']:.2f} ms, MFU {m['mfu']:.3f}, busy {busy:.2f}",
                     f"block attention {cls.get('block_attention', 0):.2f} ms "
                     f"(fwd {ks.get('block_attn_fwd', 0):.2f}, dq {ks.get('block_attn_bwd_dq', 0):.2f}, "
                     f"dkv {ks.get('block_attn_bwd_dkv', 0):.2f}), matmul {cls.get('matmul', 0):.1f}, "
                     f"recompiles {m.get('recompiles_after_warmup')}"))
    lm = drafter.get("loss_match", {})
    if lm:
        rows.append(("loss, compiled vs eager", f"{lm['mean_rel_diff']:.2%} mean, {lm['max_rel_diff']:.2%} max", ""))
    return rows


def print_rows(device: str | None, torch_version: str | None, rows: list[tuple[str, str, str]]) -> None:
    print(f"\n{device}, torch {torch_version}")
    for r in rows:
        print(f"{r[0]:44} | {r[1]:40} | {r[2]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter_json")
    ap.add_argument("--out", help="write {device, torch, rows} here")
    a = ap.parse_args()
    drafter = load(a.drafter_json)
    summary = {"device": drafter.get("device"), "torch": drafter.get("torch"), "rows": drafter_rows(drafter)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)
    print_rows(summary["device"], summary["torch"], summary["rows"])


if __name__ == "__main__":
    main()
