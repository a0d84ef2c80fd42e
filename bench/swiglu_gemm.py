"""The SwiGLU with its gate and up projections in one Triton GEMM (dflash_mp/swiglu.py), against what
the forward runs today: two cuBLAS GEMMs and Inductor's SwiGLU kernel.

At the 8B target's shapes (one packed row, M = 3072; K = 4096; N = 12288) the separate path writes the
two projections (151 MB) and reads them back; the fused kernel writes h (75 MB) alone. It gains if its
GEMM runs within that traffic's time of cuBLAS's. Each variant is timed back to back, alternating, and
checked against the product in fp32 (its largest error next to the separate path's).

    python swiglu_gemm.py [--rows 3072] [--hidden 4096] [--inter 12288] [--tiles 128,128,64,8,8,4,0;...]
        [--gate-up] [--backward]   (from bench/)

A drafter's MLP (training) keeps both projections for its backward: `--gate-up` also times each tile's
form that writes them from its accumulators (`swiglu_gu_op`), against the same separate path, which
writes them anyway; at the 8B drafter's rows (M = 8192) it saves the read-back alone.

`--backward` times the training MLP's backward GEMM instead (`swiglu_bwd_op`: dh = dy Wd with the
SwiGLU's gradient as its epilogue, writing dg and du) against cuBLAS's dh and Inductor's SwiGLU
backward, which write dh and read it back (2 x M x N elements); its errors are dg's and du's, the
larger, against fp32.

Prints a table and writes swiglu_gemm.json (`--backward`: swiglu_bwd.json) under $OUT (or bench/results)."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import median, sync, timed, write_json
from dflash_mp.swiglu import TILES, TILES_BWD, swiglu_bwd_op, swiglu_gu_op, swiglu_op

CEILING = 790e12
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, persistent): the default first, then one change each.
VARIANTS = [TILES, (128, 128, 64, 8, 8, 3, False), (128, 128, 64, 8, 8, 4, True), (128, 128, 64, 8, 8, 3, True),
            (128, 64, 64, 8, 4, 5, False), (256, 64, 64, 8, 8, 4, False)]
# The backward GEMM's: 128 x 256 spills on sm_90 (bench/kernel_resources.py), timed to see what it costs.
VARIANTS_BWD = [TILES_BWD, (128, 128, 64, 8, 8, 3, False), (128, 128, 64, 8, 8, 4, True),
                (64, 256, 64, 8, 8, 4, False), (128, 128, 64, 8, 4, 4, False), (128, 256, 64, 8, 8, 3, False)]


def backward_fns(M: int, K: int, N: int, variants, dev) -> tuple[dict, object, int]:
    """The backward's variants ({name: fn}), the fp32 (dg, du) they approximate, and the GEMM's FLOPs."""
    g = torch.Generator(device=dev).manual_seed(0)
    dy = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
    wd = (torch.randn(K, N, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
    gate, up = (torch.randn(M, N, device=dev, generator=g).to(torch.bfloat16) for _ in range(2))
    dh, gf, uf = dy.float() @ wd.float(), gate.float(), up.float()
    s = torch.sigmoid(gf)
    exact = (dh * uf * s * (1 + gf * (1 - s)), dh * gf * s)

    def silu_mul_grads(dh, gt, ut):  # what autograd asks of silu(g) * u, as Inductor compiles it
        s = torch.sigmoid(gt.float())
        dg = (dh * ut).float() * s * (1 + gt.float() * (1 - s))
        return dg.to(gt.dtype), (dh * F.silu(gt)).to(ut.dtype)

    grads = torch.compile(silu_mul_grads, options={"triton.autotune_pointwise": False})
    fns = {"cuBLAS dh + Inductor SwiGLU backward": lambda: grads(torch.mm(dy, wd), gate, up),
           "cuBLAS dh alone": lambda: torch.mm(dy, wd)}
    for t in variants:
        fns[f"triton {t}"] = (lambda t=t: swiglu_bwd_op(dy, wd, gate, up, list(t)))
    return fns, exact, 2 * M * K * N


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3072)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=12288)
    ap.add_argument("--tiles", default="", help="';'-separated tile tuples (default: VARIANTS)")
    ap.add_argument("--gate-up", action="store_true",
                    help="also time each tile's form that writes both projections (a training forward's)")
    ap.add_argument("--backward", action="store_true",
                    help="time the training MLP's backward GEMM (swiglu_bwd_op) instead of the forward")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda")
    M, K, N = a.rows, a.hidden, a.inter
    variants = ([tuple(int(v) for v in t.split(",")) for t in a.tiles.split(";")] if a.tiles
                else VARIANTS_BWD if a.backward else VARIANTS)
    if a.backward:
        fns, exact, flop = backward_fns(M, K, N, variants, dev)
        return compare(fns, exact, flop, "cuBLAS dh + Inductor SwiGLU backward", a, "swiglu_bwd.json",
                       (M, K, N))
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
    wg, wu = ((torch.randn(N, K, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16) for _ in range(2))
    exact = F.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)
    silu_mul = torch.compile(lambda gt, ut: F.silu(gt) * ut, options={"triton.autotune_pointwise": False})
    w_cat = torch.cat([wg, wu])

    def separate():
        return silu_mul(F.linear(x, wg), F.linear(x, wu))

    def one_gemm():
        gu = F.linear(x, w_cat)
        return silu_mul(gu[:, :N], gu[:, N:])

    fns = {"cuBLAS gate, up + Inductor SwiGLU": separate, "cuBLAS gate|up as one GEMM + SwiGLU": one_gemm,
           "cuBLAS gate, up alone": lambda: (F.linear(x, wg), F.linear(x, wu))}
    for t in variants:
        fns[f"triton {t}"] = (lambda t=t: swiglu_op(x, wg, wu, list(t)))
        if a.gate_up:  # against "separate", which writes the projections too
            fns[f"triton {t} +g,u"] = (lambda t=t: swiglu_gu_op(x, wg, wu, list(t))[0])
    compare(fns, (exact,), 2 * M * K * 2 * N, "cuBLAS gate, up + Inductor SwiGLU", a, "swiglu_gemm.json",
            (M, K, N))


def compare(fns: dict, exact: tuple, flop: int, base_name: str, a, json_name: str, shape) -> None:
    """Time `fns` back to back, alternating; print the table (against `base_name`) and write it."""
    dev = torch.device("cuda")
    M, K, N = shape
    rows, err = {}, {}
    for name, fn in list(fns.items()):
        try:
            out = fn()
            sync(dev)
        except Exception as e:  # noqa: BLE001 - a tile that does not fit: say so, time the rest
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            del fns[name]
            continue
        outs = (out,) if isinstance(out, torch.Tensor) else out
        if len(outs) == len(exact):  # "alone" rows return what the fused path never writes
            err[name] = max((o.float() - e).abs().max().item() / e.abs().max().item()
                            for o, e in zip(outs, exact))
        timed(fn, 3, dev)
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(a.rounds):  # alternating, so a card's drift reaches every variant alike
        for name, fn in fns.items():
            times[name] += timed(fn, a.iters, dev)
    base = median(times[base_name])
    print(f"\n{torch.cuda.get_device_name()}, M={M} K={K} N={N}, torch {torch.__version__}")
    print(f"{'variant':52} {'ms':>8} {'TFLOP/s':>8} {'vs separate':>11} {'max err':>9}")
    for name, ts in times.items():
        ms = median(ts)
        rows[name] = {"ms": ms, "tflops": flop / ms / 1e9, "min_ms": min(ts), "max_rel_err": err.get(name)}
        e = f"{err[name]:.2e}" if name in err else "-"
        print(f"{name:52} {ms:8.4f} {flop / ms / 1e9:8.1f} {ms - base:+11.4f} {e:>9}")
    write_json({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M, "K": K, "N": N,
                "ceiling": CEILING, "rows": rows}, json_name)


if __name__ == "__main__":
    main()
