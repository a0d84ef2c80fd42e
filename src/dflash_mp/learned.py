"""A tiny target that knows something, and the pipeline that proves a drafter learns it.

`builtin:tiny-qwen3` is randomly initialised: its greedy output is noise, so a drafter trained on it
proves little about learning. `builtin:learned-qwen3` has the same shapes but is trained for about a
minute on CPU on chats built from text every CPython install ships (the first paragraph of the
docstrings of a fixed list of stdlib functions and classes, asked for as "What does `json.dumps`
do?"), mixed with the synthetic demo conversations. It is built once, deterministically (seeded),
and cached like the tiny target; the cache name carries a hash of the corpus, so a Python whose
docstrings differ gets its own copy.

    python -m dflash_mp.learned build-target [--out DIR]
    python -m dflash_mp.learned pipeline --work DIR    # regenerate -> torchrun train -> evaluate

The pipeline: the learned target regenerates the assistant turns of a slice of the demo data
(`dflash_mp.regenerate`), `torchrun -m dflash_mp.main` trains a drafter on that, and
`dflash_mp.evaluate` measures `tau_sim` and live speculative decoding, for the trained drafter and
for an untrained one.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import math
import os
import random
import subprocess
import sys
import time

import torch

from .demo import (
    TINY_QWEN3,
    build_demo_tokenizer,
    default_cache_dir,
    demo_qwen3_config,
    demo_texts,
)
from .fsutil import file_lock, write_atomic

LEARNED_TARGET = "builtin:learned-qwen3"
# Bump when the corpus recipe, the tokenizer, the shapes or the training recipe change.
LEARNED_VERSION = 1

# Shapes and training recipes. tiny: about a minute on a laptop CPU. medium: 39.4M parameters, the
# GPU run of the learning proof: 80 ms/step on one H200 (measured), its loss flat after ~500 steps.
SIZES = {
    "tiny": dict(shapes=TINY_QWEN3, num_steps=160, batch_size=8, seq_len=128, lr=3e-3),
    "medium": dict(shapes=dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4,
                               head_dim=64, intermediate_size=1536, max_position_embeddings=4096),
                   num_steps=1000, batch_size=32, seq_len=512, lr=1e-3),
}
TARGETS = {"tiny": LEARNED_TARGET, "medium": "builtin:learned-qwen3-medium"}

# Modules whose public functions/classes lend their docstrings; all are in every CPython install.
DOC_MODULES = (
    "base64", "bisect", "calendar", "collections", "copy", "csv", "datetime", "difflib", "fnmatch",
    "fractions", "functools", "glob", "heapq", "html", "itertools", "json", "math", "operator",
    "os.path", "pathlib", "random", "re", "shutil", "statistics", "string", "struct", "textwrap",
    "time", "zlib",
)
QUESTIONS = ("What does {name} do?", "Explain {name}.", "What is {name} for?")


def stdlib_doc_chats(modules: tuple[str, ...] = DOC_MODULES) -> list[dict]:
    """One chat per documented public function/class: the question, then its docstring's first paragraph."""
    chats = []
    for mod_name in modules:
        mod = importlib.import_module(mod_name)
        root = mod_name.split(".")[0]
        for name in sorted(dir(mod)):
            obj = getattr(mod, name)
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            owner = getattr(obj, "__module__", None) or root
            if not owner.lstrip("_").startswith(root.lstrip("_")) and owner != "builtins":
                continue  # re-exported from elsewhere (pathlib.S_ISLNK comes from stat)
            doc = inspect.getdoc(obj)
            para = " ".join((doc or "").split("\n\n")[0].split())
            if not 20 <= len(para) <= 400:
                continue
            full = f"{mod_name}.{name}"
            q = QUESTIONS[int(hashlib.sha256(full.encode()).hexdigest(), 16) % len(QUESTIONS)]
            chats.append({"messages": [{"role": "user", "content": q.format(name=full)},
                                       {"role": "assistant", "content": para}]})
    return chats


def demo_chats() -> list[dict]:
    from .demo import demo_data_path

    with open(demo_data_path(), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def corpus_hash(chats: list[dict]) -> str:
    h = hashlib.sha256(json.dumps(chats, sort_keys=True).encode())
    return h.hexdigest()[:10]


def learned_target_dir(cache_dir: str | None = None, size: str = "tiny") -> str:
    cache = cache_dir or default_cache_dir()
    name = "learned-qwen3" if size == "tiny" else f"learned-qwen3-{size}"
    return os.path.join(cache, f"{name}-v{LEARNED_VERSION}-{corpus_hash(stdlib_doc_chats())}")


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def _token_stream(tokenizer, chats: list[dict], seed: int, epochs: int) -> list[int]:
    """All conversations rendered with the chat template, shuffled per epoch, concatenated."""
    encoded = [tokenizer.apply_chat_template(c["messages"], tokenize=False) for c in chats]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in encoded]
    r = random.Random(seed)
    stream: list[int] = []
    for _ in range(epochs):
        order = list(range(len(ids)))
        r.shuffle(order)
        for i in order:
            stream += ids[i]
    return stream


def train_learned_target(out_dir: str, seed: int = 0, size: str = "tiny", log_every: int = 250,
                         **recipe_overrides) -> str:
    """Train a small Qwen3 on stdlib-docstring and demo chats; save model + tokenizer to `out_dir`.

    On the GPU when there is one (bf16 autocast), else on the CPU. `recipe_overrides` replace
    SIZES[size] entries (num_steps, batch_size, seq_len, lr).
    """
    from transformers import AutoModelForCausalLM

    if size not in SIZES:
        raise ValueError(f"learned target size {size!r}: use one of {sorted(SIZES)}")
    unknown = set(recipe_overrides) - set(SIZES[size])
    if unknown:
        raise ValueError(f"unknown recipe fields {sorted(unknown)}: use {sorted(SIZES[size])}")
    recipe = {**SIZES[size], **recipe_overrides}
    num_steps, batch_size, seq_len, lr = (recipe[k] for k in ("num_steps", "batch_size", "seq_len", "lr"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    doc_chats, chats = stdlib_doc_chats(), demo_chats()
    # Docstrings are the part worth knowing: seen twice as often as the synthetic chats.
    corpus = doc_chats * 2 + chats
    tokenizer = build_demo_tokenizer(demo_texts() + [m["content"] for c in doc_chats for m in c["messages"]])
    config = demo_qwen3_config(tokenizer, **recipe["shapes"])  # spare vocab rows: one is the mask token
    tokens_needed = num_steps * batch_size * (seq_len + 1)
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(device)
        one_epoch = len(_token_stream(tokenizer, corpus, seed, 1))
        stream = torch.tensor(_token_stream(tokenizer, corpus, seed, math.ceil(tokens_needed / one_epoch)))
        rows = stream[: tokens_needed].view(num_steps, batch_size, seq_len + 1).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        warm = max(1, num_steps // 20)
        model.train()
        for step in range(num_steps):
            scale = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (num_steps - warm)))
            for g in opt.param_groups:
                g["lr"] = lr * max(scale, 0.02)
            x = rows[step]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if log_every and (step % log_every == 0 or step == num_steps - 1):
                print(f"learned target step {step + 1}/{num_steps} loss {loss.item():.3f} "
                      f"({time.perf_counter() - t0:.0f} s, {device.type})", file=sys.stderr, flush=True)
    model.cpu().eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"learned target ({size}, {n_params / 1e6:.1f}M parameters) trained in {time.perf_counter() - t0:.0f} s "
          f"on {device.type}: {num_steps} steps of {batch_size}x{seq_len} tokens", file=sys.stderr, flush=True)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    def save(tmp: str) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_atomic(out_dir, save)


def resolve_learned_target(cache_dir: str | None = None, size: str = "tiny") -> str:
    """The cached learned target's directory, trained on first use (race-safe across processes)."""
    out = learned_target_dir(cache_dir, size)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    with file_lock(out + ".lock"):  # one process trains it; the others wait, then read its copy
        if not os.path.isfile(os.path.join(out, "config.json")):
            train_learned_target(out, size=size)
    return out


# ---------------------------------------------------------------------------------------------
# The pipeline: regenerate -> train -> evaluate
# ---------------------------------------------------------------------------------------------

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


def run_pipeline(work: str, size: str = "tiny", world: int = 2, cache_dir: str | None = None,
                 extra_train: list[str] | None = None, **settings) -> dict:
    """regenerate -> torchrun train -> evaluate (trained and untrained); returns both eval reports.

    `settings` replace PROFILES[size] entries (num_rows, max_new_tokens, regen_batch, train_epochs,
    num_prompts, eval_tokens)."""
    prof = {**PROFILES[size], **settings}
    cache = cache_dir or default_cache_dir()
    target = [f"target.path={TARGETS[size]}", f"target.cache_dir={cache}"]
    resolve_learned_target(cache, size)
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "regenerated.jsonl")
    t0 = time.perf_counter()
    _python("-m", "dflash_mp.regenerate", *target, f"data.max_rows={prof['num_rows']}", f"out={data}",
            f"max_new_tokens={prof['max_new_tokens']}", f"batch_size={prof['regen_batch']}")
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
    from .export import export_drafter, load_exported
    from .model import DFlashDrafter

    with open(os.path.join(trained, "config.json")) as f:
        target_depth = json.load(f)["num_target_layers"]
    _, args = load_exported(trained)
    torch.manual_seed(seed)
    export_drafter(DFlashDrafter(args), args, out, {"num_hidden_layers": target_depth,
                                                    "hidden_size": args.hidden_size, "vocab_size": args.vocab_size})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_mp.learned")
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build-target", help="train (once) and cache a learned Qwen3")
    build.add_argument("--out", default=None, help="directory to write (default: the cache entry)")
    build.add_argument("--size", default="tiny", choices=sorted(SIZES))
    pipe = sub.add_parser("pipeline", help="regenerate -> torchrun train -> evaluate")
    pipe.add_argument("--work", required=True)
    pipe.add_argument("--size", default="tiny", choices=sorted(SIZES))
    pipe.add_argument("--rows", type=int, default=None, help="conversations to regenerate (default: the size's)")
    pipe.add_argument("--epochs", type=float, default=None, help="drafter epochs (default: the size's)")
    pipe.add_argument("--world", type=int, default=2)
    pipe.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                      help="extra training override, e.g. --train train.feature_noise=gaussian (repeatable)")
    args = parser.parse_args(argv)
    if args.cmd == "build-target":
        print(train_learned_target(args.out, size=args.size) if args.out else resolve_learned_target(size=args.size))
        return
    settings = {k: v for k, v in (("num_rows", args.rows), ("train_epochs", args.epochs)) if v is not None}
    reports = run_pipeline(args.work, size=args.size, world=args.world, extra_train=args.train, **settings)
    print(f"timings: {reports.pop('timings')}")
    with open(os.path.join(args.work, "reports.json"), "w") as f:
        json.dump(reports, f, indent=2)
    for name, rep in reports.items():
        print(f"{name:>9}: tau_sim {rep['sim']['tau_sim']:.3f}  tau_sim_anchors {rep['sim']['tau_sim_anchors']:.3f}  "
              f"live tau {rep['live']['tau']:.3f}  lossless {rep['live']['lossless']}")


if __name__ == "__main__":
    main()
