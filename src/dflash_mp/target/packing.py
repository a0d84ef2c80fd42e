"""The packing self-check every target rank runs at load: packed documents must not see each other.

A drafter trained on features that leak across packed documents learns from context serving never
has. The check probes every layer of the rank's stage on its own, in the dtype and with the kernels
the run uses (bf16 on a GPU, flex or sdpa, the varlen linear-attention path), on a row of documents:

- leak: the other documents' inputs to the layer are replaced by noise; a document's outputs must
  not move. Nothing of theirs may reach it, so a leak-free layer moves it by rounding at most (none
  at all for attention, whose masked scores are exact zeros; an ulp where a MoE's expert matmuls see
  other token counts), while a leak moves it by the size of what it mixes in.
- alone: the document run by itself must give what it gets packed (its positions restart, its masks
  are its own). Compared by the median over its tokens: a row of another length rounds differently,
  and in a MoE a near-tie in the router can flip a token's experts; what packing gets wrong (positions,
  a mask) moves most tokens.

Layer by layer, rounding never compounds with depth: the tolerances hold at any depth, and a leak is
caught at the layer that has it. (A whole-model comparison of the packed row against each document
alone cannot tell a leak from rounding at depth: in bf16 the two reach the same size.)
"""

from __future__ import annotations

import logging

import torch

from .linear_attn import documents

log = logging.getLogger(__name__)

# Relative per-token change a leak-free layer stays below: (leak, alone) by probe dtype.
TOLERANCES = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (2e-2, 3e-2), torch.float16: (1e-2, 2e-2)}


def per_token_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token relative difference of [1, n, H] tensors."""
    a, b = a[0].float(), b[0].float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def probe_row(worker, lengths, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed probe row of documents of `lengths` tokens, drawn from `g`: (input, position ids, doc
    ids), on the CPU. The input is token ids `[n]` for a stage that starts at the embedding, else a
    random residual stream `[n, hidden]` in the worker's dtype (another stage's output stands in)."""
    n = sum(lengths)
    docs = torch.cat([torch.full((m,), d) for d, m in enumerate(lengths)])
    pos = torch.cat([torch.arange(m) for m in lengths])
    if worker.first_stage:
        x = torch.randint(worker.decoder.embed_tokens.weight.shape[0], (n,), generator=g)
    else:
        x = torch.randn(n, worker.hidden_size, generator=g).to(worker.dtype)
    return x, pos, docs


class ProbeRow:
    """One probe row's position ids, masks, spans and RoPE tables, as the worker's forward builds them."""

    def __init__(self, worker, docs: torch.Tensor, pos: torch.Tensor, like: torch.Tensor):
        self.pos = pos.to(worker.device)[None]
        self.masks = worker.masks(docs.to(worker.device))
        self.spans = worker.spans(docs)
        self.rope = worker.rope(like, self.pos)

    def run(self, worker, i: int, h: torch.Tensor, compiled: bool = False, deferred: bool | None = None
            ) -> torch.Tensor:
        with documents(self.spans):
            return worker.run_layer(i, h, self.pos, self.rope, self.masks, compiled=compiled, deferred=deferred)


@torch.inference_mode()
def check_packing(worker, lengths: tuple[int, ...] = (128, 256), seed: int = 0) -> dict[int, float]:
    """Probe every layer of `worker`'s stage (module docstring); raise a ValueError naming the target
    class, the first layer at fault and the fix. Returns {layer: largest relative difference}.
    Eager (a compiled target compiles no probe shapes). Lengths are multiples of 128 (flex blocks)."""
    g = torch.Generator().manual_seed(seed)
    dev, dtype = worker.device, worker.dtype
    x, pos, docs = probe_row(worker, lengths, g)
    h = (worker.decoder.embed_tokens(x.to(dev)) if worker.first_stage else x.to(dev))[None]
    starts = [sum(lengths[:d]) for d in range(len(lengths))]
    spans = [(s, s + m) for s, m in zip(starts, lengths)]
    row = ProbeRow(worker, docs, pos, h)
    alone_rows = [ProbeRow(worker, torch.zeros(m, dtype=torch.long), torch.arange(m), h[:, :m]) for m in lengths]
    tol_leak, tol_alone = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    diffs: dict[int, float] = {}
    for i in range(*worker.stage_layers):
        out = row.run(worker, i, h)
        scale = h.float().pow(2).mean(-1, keepdim=True).sqrt()
        for d, (s, e) in enumerate(spans):
            noisy = (torch.randn(h.shape, generator=g).to(dev) * scale).to(h.dtype)
            noisy[:, s:e] = h[:, s:e]
            leak = float(per_token_rel(row.run(worker, i, noisy)[:, s:e], out[:, s:e]).max())
            alone = float(per_token_rel(alone_rows[d].run(worker, i, h[:, s:e]), out[:, s:e]).median())
            diffs[i] = max(diffs.get(i, 0.0), leak, alone)
            where = f"target {type(worker.model).__name__}: layer {i} ({worker.layer_types[i]})"
            if not leak <= tol_leak:
                raise ValueError(
                    f"{where} lets packed documents see each other: replacing the other documents' inputs moves "
                    f"document {d}'s outputs by {leak:.2e} (relative, tolerance {tol_leak:.1e}), so the drafter "
                    f"would train on leaked features. {_FIX}")
            if not alone <= tol_alone:
                raise ValueError(
                    f"{where} gives document {d} of a packed row other outputs than the document alone "
                    f"({alone:.2e} median relative difference, tolerance {tol_alone:.1e}): positions or masks "
                    f"of packed rows are not what it reads. {_FIX}")
        h = out
    first, end = worker.stage_layers
    log.info("target %s packs exactly: layers %d-%d in %s move a document by at most %.1e when the others "
             "change or it runs alone (tolerances %.0e / %.0e)", type(worker.model).__name__, first, end - 1,
             str(dtype).replace("torch.", ""), max(diffs.values()), tol_leak, tol_alone)
    return diffs


_FIX = ("Use a target whose layers honour the packed-document mask (or run it with another "
        "target.attn_implementation); target.packing_check=false skips this check at the cost of those "
        "leaked features.")
