"""Whether the drafter's AdamW pass could hide under the next step's forward matmuls, measured before
anything is built for it.

In the captured step (step_graph.py) the update of step n runs after its backward, alone on the GPU:
9.1 ms of the 8B step on an H100 (26 bytes for each of 1.05 G parameters). The next forward's matmuls
are compute-bound and leave the memory mostly idle. An update of step n could run at the start of step
n + 1 on a side stream instead, each layer's weights updated before that layer's forward reads them,
the same numbers. What that gains depends on how the GPU shares its SMs and its 700 W between a
memory-bound kernel and cuBLAS's, which no count predicts. This times, on the 8B drafter's shapes:

- `gemm`: the forward's matmuls alone (fc, 5 layers' q/k/v/o/gate/up/down, the LM head in chunks);
- `adamw`: the update alone (the optimizer's compiled `adamw_update_each`, one segment for the fc and
  one per layer, the split master's buffers);
- `serial`: the update, then the matmuls, on one stream (today's order);
- `overlap-lo` / `overlap-hi`: the update on a side stream of low / high priority, each layer's matmuls
  waiting for that layer's segment;

each launched and as a replayed CUDA graph (`graph-*`), in turn, repeated. Prints a table and writes
adamw_overlap.json under $OUT (or bench/results):

    python bench/adamw_overlap.py [--repeats 5] [--iters 10]        (from bench/; --device cpu: a smoke test)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import DRAFTERS, median, sync, timed, write_json
from dflash_mp.optim import adamw_update_each

CEILING = 790e12
COPY_CEILING = 4.3e12
BYTES_PER_PARAM = 26  # bf16 grad read; bf16 upper and int16 lower halves, fp32 m and v: read and written


def shapes(p: dict) -> tuple[list[tuple[int, int, int]], list[list[tuple[int, int, int]]], list[tuple[int, int, int]]]:
    """(rows, in, out) of the fc, of each layer's linears, of the LM head's chunks."""
    h, i, q, kv = p["hidden"], p["inter"], p["heads"] * p["head_dim"], p["kv"] * p["head_dim"]
    blocks, ctx = p["anchors"] * p["block"], p["seq_len"]
    layer = [(blocks, h, q), (blocks + ctx, h, kv), (blocks + ctx, h, kv), (blocks, q, h),
             (blocks, h, i), (blocks, h, i), (blocks, i, h)]
    predicted = p["anchors"] * (p["block"] - 1)
    chunks = 4
    head = [(predicted // chunks, h, p["vocab"])] * chunks
    return [(ctx, p["k"] * h, h)], [layer] * p["layers"], head


class Probe:
    def __init__(self, p: dict, device: torch.device):
        fc, layers, head = shapes(p)
        bf16 = dict(dtype=torch.bfloat16, device=device)
        # Segment 0: the fc; segment i + 1: layer i. Each linear's weight is a segment's parameter.
        self.segments = [fc] + layers
        self.inputs = {}
        self.weights: list[list[torch.Tensor]] = []
        self.state: list[list[list[torch.Tensor]]] = []
        for seg in self.segments:
            ws = [torch.randn(o, i, **bf16) * 0.02 for (_, i, o) in seg]
            for (r, i, _) in seg:
                self.inputs.setdefault((r, i), torch.randn(r, i, **bf16))
            self.weights.append(ws)
            lows = [torch.zeros(w.shape, dtype=torch.int16, device=device) for w in ws]
            grads = [torch.randn_like(w) * 1e-3 for w in ws]
            m = [torch.zeros(w.shape, dtype=torch.float32, device=device) for w in ws]
            v = [torch.zeros(w.shape, dtype=torch.float32, device=device) for w in ws]
            self.state.append([lows, grads, m, v, ws])
        self.head_w = torch.randn(p["vocab"], p["hidden"], **bf16) * 0.02
        for (r, i, _) in head:
            self.inputs.setdefault((r, i), torch.randn(r, i, **bf16))
        self.head = head
        f32 = dict(dtype=torch.float32, device=device)
        self.step, self.lr = torch.ones((), **f32), torch.full((), 1e-4, **f32)
        self.divisor, self.skip = torch.ones((), **f32), torch.zeros((), **f32)
        compiled = device.type == "cuda"
        self.update = torch.compile(adamw_update_each, dynamic=False, fullgraph=True) if compiled else adamw_update_each
        self.params = sum(w.numel() for ws in self.weights for w in ws)
        self.flop = 2 * sum(r * i * o for seg in self.segments for (r, i, o) in seg) + \
            2 * sum(r * i * o for (r, i, o) in head)
        self.device = device
        self.side = {pr: torch.cuda.Stream(device, priority=pr) for pr in (0, -1)} if compiled else {}

    def update_segment(self, s: int) -> None:
        self.update(*self.state[s], self.step, self.lr, self.divisor, self.skip,
                    beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)

    def forward_segment(self, s: int) -> None:
        for (r, i, _), w in zip(self.segments[s], self.weights[s]):
            F.linear(self.inputs[(r, i)], w)

    def forward_head(self) -> None:
        for (r, i, _) in self.head:
            F.linear(self.inputs[(r, i)], self.head_w)

    def gemm(self) -> None:
        for s in range(len(self.segments)):
            self.forward_segment(s)
        self.forward_head()

    def adamw(self) -> None:
        for s in range(len(self.segments)):
            self.update_segment(s)

    def serial(self) -> None:
        self.adamw()
        self.gemm()

    def overlap(self, priority: int) -> None:
        side, main = self.side[priority], torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        events = []
        with torch.cuda.stream(side):
            for s in range(len(self.segments)):
                self.update_segment(s)
                events.append(side.record_event())
        for s in range(len(self.segments)):
            main.wait_event(events[s])
            self.forward_segment(s)
        self.forward_head()
        main.wait_stream(side)


def graphed(fn, device: torch.device):
    """`fn` captured once (after a launched warm-up on a side stream) and replayed."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3_8b", choices=sorted(DRAFTERS))
    ap.add_argument("--repeats", type=int, default=5, help="rounds of every variant, in turn")
    ap.add_argument("--iters", type=int, default=10, help="timed calls of a variant a round")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    probe = Probe(DRAFTERS[args.preset], dev)
    variants = {"gemm": probe.gemm, "adamw": probe.adamw, "serial": probe.serial}
    if dev.type == "cuda":
        variants.update({"overlap-lo": lambda: probe.overlap(0), "overlap-hi": lambda: probe.overlap(-1)})
        for name in list(variants):
            variants[f"graph-{name}"] = graphed(variants[name], dev)
    for fn in variants.values():  # compile, load kernels, settle the clocks
        fn()
        fn()
    sync(dev)
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(median(timed(fn, args.iters, dev)))
    rows = []
    for name, ts in times.items():
        ms = median(ts)
        rows.append(dict(variant=name, ms=ms, runs=ts))
    by = {r["variant"]: r["ms"] for r in rows}
    print(f"\n{probe.params / 1e9:.3f} G parameters ({probe.params * BYTES_PER_PARAM / 1e9:.1f} GB an update), "
          f"{probe.flop / 1e12:.1f} TFLOP of forward matmuls; {args.repeats} rounds of {args.iters} calls")
    print("| variant | ms | of serial | hidden of the update | TFLOP/s of the matmuls | update TB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for prefix in ("", "graph-"):
        if prefix + "serial" not in by:
            continue
        serial, alone_u = by[prefix + "serial"], by[prefix + "adamw"]
        for name in ("gemm", "adamw", "serial", "overlap-lo", "overlap-hi"):
            if prefix + name not in by:
                continue
            ms = by[prefix + name]
            hidden = (serial - ms) / alone_u if name.startswith("overlap") else None
            print(f"| {prefix + name} | {ms:.3f} | {ms / serial:.3f} | "
                  f"{'-' if hidden is None else f'{hidden:.2f} ({serial - ms:.2f} ms)'} | "
                  f"{'-' if name == 'adamw' else f'{probe.flop / ms / 1e9:.0f}'} | "
                  f"{'-' if name == 'gemm' else f'{probe.params * BYTES_PER_PARAM / alone_u / 1e9:.2f}'} |")
    write_json(dict(preset=args.preset, device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    torch=torch.__version__, params=probe.params, flop=probe.flop, rows=rows), "adamw_overlap.json")


if __name__ == "__main__":
    main()
