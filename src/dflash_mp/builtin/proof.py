"""The learning proof, a tool: the learned target regenerates the assistant turns of a slice of the
demo data (`dflash_mp.regenerate`), `torchrun -m dflash_mp.main` trains a drafter on that, and
`dflash_mp.evaluate` measures `tau_sim` and live speculative decoding, for the trained drafter and for
an untrained one. Every stage runs as its own process, as a user would run it.

    python -m dflash_mp.builtin.proof proof.work=DIR [proof.size=medium] [JOB OVERRIDES ...]

Job overrides (`train.feature_noise=gaussian`) go to the training run only, after the size's own
(so they win); they are checked before anything runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import MISSING

from ..cli import entry, tool_main
from ..export import export_drafter, load_exported
from ..model import DFlashDrafter
from .learned import build_learned_target
from .names import LEARNED_TARGETS, cache_root

# Per size: drafter training overrides, evaluation overrides, regeneration and pipeline settings.
# tiny fits a laptop CPU (1 target + 1 drafter rank); medium is the GPU run (B=16; eager drafter
# with dense masks and an sdpa target: small shapes, so nothing waits minutes for kernels to compile).
# Replies are capped short to keep regeneration cheap, so many are cut (a quarter of the tiny rows):
# keep them, open, rather than drop them (data.unfinished).
_COMMON = ["data.eval_fraction=0.1", "logging.progress=false", "train.compile=eager", "checkpoint.every=0",
           "data.unfinished=keep_open"]
PROFILES = {
    "tiny": dict(
        train=["data.seq_len=512", "drafter.block_size=8", "drafter.num_anchors=64", "drafter.max_anchors_per_doc=16",
               "drafter.loss_chunk_size=256", "train.lr=3e-3", "logging.log_every=20", *_COMMON],
        eval=["data.seq_len=512", "data.eval_fraction=0.1", "data.unfinished=keep_open"],
        num_rows=240, max_new_tokens=96, regen_batch=32, train_epochs=4.0, num_prompts=12, eval_tokens=64),
    "medium": dict(
        train=["data.seq_len=1024", "drafter.block_size=16", "drafter.num_layers=2", "drafter.num_anchors=256",
               "drafter.max_anchors_per_doc=32", "drafter.loss_chunk_size=1024", "train.lr=1e-3",
               "logging.log_every=100", "drafter.attention=dense", "target.attn_implementation=sdpa",
               "target.compile=false", *_COMMON],
        eval=["data.seq_len=1024", "data.eval_fraction=0.1", "data.unfinished=keep_open", "drafter.attention=dense",
              "target.attn_implementation=sdpa"],
        num_rows=800, max_new_tokens=160, regen_batch=200, train_epochs=5.0, num_prompts=32, eval_tokens=128),
}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def _python(*args: str, timeout: float | None = None) -> None:
    subprocess.run([sys.executable, *args], env=_env(), check=True, timeout=timeout)


def run_pipeline(work: str, size: str = "tiny", world: int = 2, cache_dir: str = "",
                 extra_train: list[str] | None = None, regen_cache: str = "auto", **settings) -> dict:
    """regenerate -> torchrun train -> evaluate (trained and untrained); returns both eval reports.

    `settings` replace PROFILES[size] entries (num_rows, max_new_tokens, regen_batch, train_epochs,
    num_prompts, eval_tokens)."""
    prof = {**PROFILES[size], **settings}
    cache = cache_root(cache_dir or "")
    target = [f"target.path={LEARNED_TARGETS[size]}", f"target.cache_dir={cache}"]
    build_learned_target(cache, size)
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "regenerated.jsonl")
    t0 = time.perf_counter()
    _python("-m", "dflash_mp.regenerate", *target, f"data.max_rows={prof['num_rows']}", f"out={data}",
            f"max_new_tokens={prof['max_new_tokens']}", f"batch_size={prof['regen_batch']}", f"cache={regen_cache}")
    timings = {"regenerate_s": time.perf_counter() - t0}
    run_dir = os.path.join(work, "run")
    train = [*target, f"data.path={data}", f"run_dir={run_dir}", "topology.num_target_ranks=1",
             f"train.epochs={prof['train_epochs']}", *prof["train"], *(extra_train or [])]
    t0 = time.perf_counter()
    _python("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m", "dflash_mp.main",
            *train)
    timings["train_s"] = time.perf_counter() - t0
    export = os.path.join(run_dir, "export")
    untrained = os.path.join(work, "untrained")
    _export_untrained(export, untrained)
    reports = {}
    for name, ckpt in (("trained", export), ("untrained", untrained)):
        out = os.path.join(work, f"eval_{name}.json")
        _python("-m", "dflash_mp.evaluate", f"checkpoint={ckpt}", *target, f"data.path={data}", *prof["eval"],
                f"eval.num_prompts={prof['num_prompts']}", f"eval.max_new_tokens={prof['eval_tokens']}",
                f"eval.out={out}")
        with open(out) as f:
            reports[name] = json.load(f)
    reports["timings"] = timings
    return reports


def _export_untrained(trained: str, out: str, seed: int = 0) -> None:
    """The trained export's shapes with the trainer's initial weights (what step 0 would export)."""
    with open(os.path.join(trained, "config.json")) as f:
        target_depth = json.load(f)["num_target_layers"]
    _, args = load_exported(trained)
    torch.manual_seed(seed)
    export_drafter(DFlashDrafter(args), args, out, {"num_hidden_layers": target_depth,
                                                    "hidden_size": args.hidden_size, "vocab_size": args.vocab_size})


@dataclass
class ProofConfig:
    work: str = MISSING  # directory of the run: regenerated data, training run, exports, reports.json
    size: str = "tiny"  # learned target and profile: tiny (a CPU) or medium (a GPU)
    rows: Optional[int] = None  # conversations to regenerate; null = the size's
    epochs: Optional[float] = None  # drafter training epochs; null = the size's
    world_size: int = 2  # processes of the training run: one target rank, the rest drafter ranks
    regen_cache: str = "auto"  # regeneration's KV cache (regen.cache): auto | dynamic | static


def run_proof(opts: ProofConfig, train: list[str]) -> dict:
    """The pipeline with `train` (job overrides) added to its training run; prints and writes the reports."""
    if opts.size not in PROFILES:
        raise ValueError(f"proof.size={opts.size!r} is not a size; use one of {', '.join(PROFILES)}.")
    settings = {k: v for k, v in (("num_rows", opts.rows), ("train_epochs", opts.epochs)) if v is not None}
    reports = run_pipeline(opts.work, size=opts.size, world=opts.world_size, extra_train=train,
                           regen_cache=opts.regen_cache, **settings)
    print(f"timings: {reports.pop('timings')}")
    with open(os.path.join(opts.work, "reports.json"), "w") as f:
        json.dump(reports, f, indent=2)
    for name, rep in reports.items():
        print(f"{name:>9}: tau_sim {rep['sim']['tau_sim']:.3f}  tau_sim_anchors {rep['sim']['tau_sim_anchors']:.3f}  "
              f"live tau {rep['live']['tau']:.3f}  lossless {rep['live']['lossless']}")
    return reports


def main(argv: list[str] | None = None) -> None:
    tool_main("proof", ProofConfig, run_proof, __doc__, argv, job="overrides")


if __name__ == "__main__":
    entry(main)
