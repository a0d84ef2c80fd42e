"""The GPU-turn race of a target and a drafter sharing one GPU, on the CPU: does a ring that ran empty
refill?

Two processes take turns with the job's own `GpuTurns` (a flock) and poll a two-slot ring with the
job's own `backoff_sleep`, in the order of `roles.py`'s loops. A turn's GPU work is a sleep of the
measured length (8B target forward 67 ms, drafter step 120 ms); the target packs each next batch
(0.9 ms, the median at 8B shapes on the H200 host) either after its send (`pack-after-send`, the loop
before `TargetRun.pack_ahead`) or inside its turn (`pack-in-turn`); `+target-first` gives the target
the turn before a waiting drafter (`GpuTurns.first`). The job now runs `pack-in-turn+target-first`.
The ring starts empty with the drafter waiting, the state call Z5's job stayed in. A step where the
drafter waited more than half a forward for its batch is a starved step.

    python bench/turn_race.py [--steps 40] [--repeats 2]

Prints one row per run (modes interleaved) and a JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch

from dflash_mp.gpu_turns import GpuTurns
from dflash_mp.transport.base import backoff_sleep

CPU = torch.device("cpu")
DEPTH = 2
MODES = ("pack-after-send", "pack-in-turn", "pack-after-send+target-first", "pack-in-turn+target-first")


def _wait(ready) -> float:
    t0, attempt = time.monotonic(), 0
    while not ready():
        backoff_sleep(attempt)
        attempt += 1
    return time.monotonic() - t0


def _busy(seconds: float) -> None:
    """CPU work of this length (packing a row): not a sleep, the core is taken."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def target(path, ring, steps, mode, forward_s, pack_s, send_s, first) -> None:
    turns = GpuTurns(path, CPU, first=first)
    head, tail = ring
    packed = False
    for seq in range(steps):
        if not packed:
            _busy(pack_s)
        with turns.turn():
            time.sleep(forward_s)  # the forward, its sync at the turn's end
            packed = "pack-in-turn" in mode and seq + 1 < steps
            if packed:
                _busy(pack_s)
        _wait(lambda: seq - tail.value < DEPTH)  # credit
        _busy(send_s)  # the send's copy and bookkeeping before the publish
        head.value = seq + 1
        _busy(send_s)  # metrics, the next step's checks


def drafter(path, ring, steps, step_s, out) -> None:
    turns = GpuTurns(path, CPU)
    head, tail = ring
    waits = []
    for seq in range(steps):
        tail.value = seq  # the previous batch's slot goes back
        waits.append(_wait(lambda: head.value > seq))
        with turns.turn():
            time.sleep(step_s)
    out.put(waits)


def run(mode: str, steps: int, forward_s: float, step_s: float, pack_s: float, send_s: float) -> dict:
    ctx = mp.get_context("spawn")
    ring = (ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False))
    out = ctx.Queue()
    path = os.path.join(tempfile.mkdtemp(), "turns")
    t0 = time.monotonic()
    first = "target-first" in mode
    ps = [ctx.Process(target=target, args=(path, ring, steps, mode, forward_s, pack_s, send_s, first)),
          ctx.Process(target=drafter, args=(path, ring, steps, step_s, out))]
    for p in ps:
        p.start()
    waits = out.get(timeout=600)
    for p in ps:
        p.join(60)
    wall = time.monotonic() - t0
    after = waits[1:]  # the first batch waits for the first forward in any order
    starved = [i + 1 for i, w in enumerate(after) if w > forward_s / 2]
    return {"mode": mode, "steps": steps, "starved_steps": len(starved),
            "last_starved": max(starved, default=0),
            "median_wait_ms": 1e3 * statistics.median(after), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--forward-ms", type=float, default=67.0)
    ap.add_argument("--step-ms", type=float, default=120.0)
    ap.add_argument("--pack-ms", type=float, default=0.9)
    ap.add_argument("--send-ms", type=float, default=0.05)
    a = ap.parse_args()
    rows = []
    for _ in range(a.repeats):
        for mode in MODES:
            r = run(mode, a.steps, a.forward_ms / 1e3, a.step_ms / 1e3, a.pack_ms / 1e3, a.send_ms / 1e3)
            print(json.dumps(r), flush=True)
            rows.append(r)
    print("\n| mode | steps | starved steps (waited > half a forward) | last starved step | median wait (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['steps']} | {r['starved_steps']} | {r['last_starved']} | "
              f"{r['median_wait_ms']:.2f} |")


if __name__ == "__main__":
    main()
