"""A staged target against the same target in one stage, all ranks sharing one GPU (shm ring).

    bash bench/run_stages_h200.sh        # the two runs, then `alone`, then `summary`

    python bench/stages.py alone  --stages 1,2 [--seq-len 3072]   # each stage's forward, timed alone
    python bench/stages.py summary --one RUN_DIR --staged RUN_DIR --alone stage_alone.json

On one GPU every rank takes turns, so staging can only cost: the samples/s ratio of the staged run
(target.stages=2: 2 target ranks + 1 drafter) to the unstaged one (1 + 1) is what the split costs
(the residual stream crossing the boundary, a third process in the GPU's time slices). A stage's
busy fraction is its share of the GPU's wall time: its forward time alone x the run's samples/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from common import QWEN3_8B_TARGET, synthetic_batch, write_json

from dflash_mp.batch import PackedBatch
from dflash_mp.stages import plan_stages
from dflash_mp.transport import SlotSpec

LAYER_IDS = [1, 9, 17, 25, 33]  # experiment=qwen3_8b


def interval_rate(path: str, skip: int) -> tuple[float, int]:
    """Drafter samples/s over the logged intervals after step `skip` (compile and warm-up excluded)."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    kept = [r for r in rows if r.get("throughput/samples_per_s") and r["step"] > skip]
    if not kept:
        raise SystemExit(f"{path}: no throughput rows after step {skip}")
    steps = [r["step"] - p["step"] for p, r in zip([{"step": skip}] + kept, kept)]
    seconds = sum(n / r["throughput/samples_per_s"] for n, r in zip(steps, kept))
    return sum(steps) / seconds, sum(steps)


def alone(a) -> None:
    from dflash_mp.builtin import resolve_target_path
    from dflash_mp.target import TargetWorker

    dev = torch.device("cuda")
    path = resolve_target_path("builtin:random-qwen3-8b")
    hb = synthetic_batch(a.seq_len, 1, QWEN3_8B_TARGET["vocab_size"], dev, torch.bfloat16)
    pb = PackedBatch(hb.input_ids, hb.position_ids, hb.doc_ids, hb.loss_mask, int(hb.doc_ids.max()) + 1, a.seq_len)
    out = {"seq_len": a.seq_len, "compile": a.compile, "stages": {}}
    for stages in [int(s) for s in a.stages.split(",")]:
        plan = plan_stages(QWEN3_8B_TARGET, LAYER_IDS, stages, a.seq_len)
        batch, rows = pb, []
        for s, layers in enumerate(plan.bounds):
            worker = TargetWorker.load(path, LAYER_IDS, dev, torch.bfloat16, compile=a.compile,
                                       packing_check=False, layers=layers)
            inp = batch
            for _ in range(3):
                batch = worker.forward(inp)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                batch = worker.forward(inp)
            torch.cuda.synchronize()
            ms = 1e3 * (time.perf_counter() - t0) / a.steps
            batch = batch.to(dev, copy=True)  # the next stage's input, as the ring delivers it
            rows.append({"stage": s, "layers": list(layers), "ms": ms})
            print(f"stages={stages} stage {s} layers {layers[0]}-{layers[1] - 1}: {ms:.1f} ms", flush=True)
            del worker
            torch.cuda.empty_cache()
        out["stages"][str(stages)] = rows
    write_json(out, "stage_alone.json")


def summary(a) -> None:
    alone_ms = json.load(open(a.alone))["stages"]
    one, n1 = interval_rate(f"{a.one}/tb/drafter/scalars.jsonl", a.skip)
    staged, n2 = interval_rate(f"{a.staged}/tb/drafter/scalars.jsonl", a.skip)
    plan = plan_stages(QWEN3_8B_TARGET, LAYER_IDS, 2, a.seq_len)
    spec = SlotSpec(a.seq_len, plan.boundary_width(0), torch.bfloat16, "cpu")
    busy = [{"stage": r["stage"], "layers": r["layers"], "ms_alone": r["ms"], "busy": r["ms"] * staged / 1e3}
            for r in alone_ms["2"]]
    out = {"samples_per_s_1_stage": one, "steps_1_stage": n1, "samples_per_s_2_stages": staged, "steps_2_stages": n2,
           "ratio": staged / one, "goal": 0.95, "split": plan.describe(),
           "boundary_bytes_per_row": spec.message_bytes, "boundary_bytes_per_token": spec.message_bytes / a.seq_len,
           "target_ms_1_stage_alone": alone_ms["1"][0]["ms"], "stage_busy": busy,
           "target_busy_1_stage": alone_ms["1"][0]["ms"] * one / 1e3}
    write_json(out, "stages_1gpu.json")
    print(f"\n{'':28s}{'1 stage':>12s}{'2 stages':>12s}")
    print(f"{'drafter samples/s':28s}{one:12.3f}{staged:12.3f}   ratio {staged / one:.3f} (goal >= 0.95)")
    parts = " + ".join(f"{r['ms']:.1f}" for r in alone_ms["2"])
    print(f"{'target forward alone, ms':28s}{alone_ms['1'][0]['ms']:12.1f}{parts:>12s}")
    for b in busy:
        print(f"stage {b['stage']} (layers {b['layers'][0]}-{b['layers'][1] - 1}) busy fraction {b['busy']:.3f}")
    print(f"boundary: {spec.message_bytes / 2**20:.1f} MiB per row of {a.seq_len} tokens "
          f"({spec.message_bytes / a.seq_len / 1024:.1f} KiB per token: residual + {plan.captured_before(1)} captured layers)")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("alone")
    p.add_argument("--stages", default="1,2")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="time the compiled forward (target.compile=true)")
    p = sub.add_parser("summary")
    p.add_argument("--one", required=True)
    p.add_argument("--staged", required=True)
    p.add_argument("--alone", required=True)
    p.add_argument("--skip", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=3072)
    a = ap.parse_args()
    alone(a) if a.cmd == "alone" else summary(a)


if __name__ == "__main__":
    sys.exit(main())
