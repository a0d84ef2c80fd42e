"""The drafter's RMSNorms, forward and backward, compiled: Inductor's backward (`autograd`) against the
one-pass kernel (`triton`, model/rms_norm.py), at the 8B drafter's shapes, with their errors against a
float64 truth.

Each call is `norm(x + residual)` and its backward for a fixed gradient, compiled as in the drafter's
layers (the forward fused with the residual add in both). Shapes: the layers' input and post-attention
norms ([8192, 4096]), the query and key norms ([8192 x 32, 128], [11264 x 8, 128]), the context's
hidden norm ([3072, 4096]). Prints a table and writes norm_bwd.json under $OUT (or bench/results):

    python bench/norm_bwd.py [--iters 50] [--repeats 3]          (from bench/; --device cpu: a smoke test)
"""

from __future__ import annotations

import argparse

import torch

from common import median, sync, timed, write_json
from dflash_mp.model.drafter import RMSNorm

COPY_CEILING = 4.3e12
SHAPES = {"layer norm": (8192, 4096), "q norm": (8192 * 32, 128), "k norm": (11264 * 8, 128),
          "hidden norm": (3072, 4096)}
VARIANTS = ("autograd", "triton")


def forward(norm, x, r):
    return norm(x + r)


def truth(x, r, w, g, eps):
    """(dx, dw) in float64 of the module's forward as written (its casts included)."""
    x64 = (x + r).double().requires_grad_()
    w64 = w.double().requires_grad_()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    (w64 * (x64 * rstd)).backward(g.double())
    return x64.grad, w64.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of both variants, in turn")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=int, default=1, help="divide the rows by this (the CPU smoke test)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    rows = []
    for name, (n, h) in SHAPES.items():
        n //= args.scale
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(n, h, generator=gen) * 2).to(dev, dtype).requires_grad_()
        r = torch.randn(n, h, generator=gen).to(dev, dtype)
        g = torch.randn(n, h, generator=gen).to(dev, dtype)
        w = (torch.rand(h, generator=gen) + 0.5).to(dev, dtype)
        want_dx, want_dw = truth(x.detach(), r, w, g, 1e-6)
        fns, errs = {}, {}
        for v in VARIANTS:
            norm = RMSNorm(h, 1e-6).to(dev)
            norm.weight.data = w.clone()
            norm.one_pass = v == "triton"
            compiled = torch.compile(forward, dynamic=False, fullgraph=True) if dev.type == "cuda" else forward

            def fn(norm, x, r, g, compiled=compiled):
                compiled(norm, x, r).backward(g)

            x.grad = norm.weight.grad = None
            fn(norm, x, r, g)
            errs[v] = (rel(x.grad, want_dx), rel(norm.weight.grad, want_dw))
            fns[v] = (fn, norm)
        ms = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for v, (fn, norm) in fns.items():
                def call(fn=fn, norm=norm):
                    x.grad = norm.weight.grad = None
                    fn(norm, x, r, g)
                call()
                sync(dev)
                ms[v].append(median(timed(call, args.iters, dev)))
        for v in VARIANTS:
            rows.append(dict(shape=name, rows=n, hidden=h, variant=v, ms=median(ms[v]), runs=ms[v],
                             dx_rel_err=errs[v][0], dw_rel_err=errs[v][1]))
    print("\n| norm | rows x hidden | variant | fwd + bwd ms | dx rel. error | dw rel. error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['shape']} | {row['rows']} x {row['hidden']} | {row['variant']} | {row['ms']:.4f} | "
              f"{row['dx_rel_err']:.2e} | {row['dw_rel_err']:.2e} |")
    write_json(dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    torch=torch.__version__, rows=rows), "norm_bwd.json")


if __name__ == "__main__":
    main()
