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
import contextlib
import hashlib
import importlib
import inspect
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile

import torch

from .demo import TINY_QWEN3, build_demo_tokenizer, default_cache_dir, demo_texts

LEARNED_TARGET = "builtin:learned-qwen3"
# Bump when the corpus recipe, the tokenizer, the shapes or the training recipe change.
LEARNED_VERSION = 1

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


def learned_target_dir(cache_dir: str | None = None) -> str:
    cache = cache_dir or default_cache_dir()
    return os.path.join(cache, f"learned-qwen3-v{LEARNED_VERSION}-{corpus_hash(stdlib_doc_chats())}")


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


def train_learned_target(out_dir: str, seed: int = 0, num_steps: int = 160, batch_size: int = 8,
                         seq_len: int = 128, lr: float = 3e-3, log_every: int = 50) -> str:
    """Train the tiny Qwen3 on stdlib-docstring and demo chats; save model + tokenizer to `out_dir`."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    doc_chats, chats = stdlib_doc_chats(), demo_chats()
    # Docstrings are the part worth knowing: seen twice as often as the synthetic chats.
    corpus = doc_chats * 2 + chats
    tokenizer = build_demo_tokenizer(demo_texts() + [m["content"] for c in doc_chats for m in c["messages"]])
    vocab_size = math.ceil((len(tokenizer) + 8) / 64) * 64  # spare rows: one becomes the mask token
    config = Qwen3Config(vocab_size=vocab_size, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **TINY_QWEN3)
    tokens_needed = num_steps * batch_size * (seq_len + 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        one_epoch = len(_token_stream(tokenizer, corpus, seed, 1))
        stream = torch.tensor(_token_stream(tokenizer, corpus, seed, math.ceil(tokens_needed / one_epoch)))
        rows = stream[: tokens_needed].view(num_steps, batch_size, seq_len + 1)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        warm = max(1, num_steps // 20)
        model.train()
        for step in range(num_steps):
            scale = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (num_steps - warm)))
            for g in opt.param_groups:
                g["lr"] = lr * max(scale, 0.02)
            x = rows[step]
            logits = model(input_ids=x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if log_every and (step % log_every == 0 or step == num_steps - 1):
                print(f"learned target step {step + 1}/{num_steps} loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.eval()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    _save_atomic(model, tokenizer, out_dir)
    return out_dir


def _save_atomic(model, tokenizer, out_dir: str) -> None:
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-learned-")
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process finished first: keep its copy
            if not os.path.isfile(os.path.join(out_dir, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(path: str):
    """Only one process trains the target; the others wait and then read its copy."""
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def resolve_learned_target(cache_dir: str | None = None) -> str:
    """The cached learned target's directory, trained on first use (race-safe across processes)."""
    out = learned_target_dir(cache_dir)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    with _build_lock(out + ".lock"):
        if not os.path.isfile(os.path.join(out, "config.json")):
            train_learned_target(out)
    return out


# ---------------------------------------------------------------------------------------------
# The pipeline: regenerate -> train -> evaluate
# ---------------------------------------------------------------------------------------------

# Drafter training overrides that fit a laptop CPU (1 target + 1 drafter rank).
PIPELINE_TRAIN = [
    "data.seq_len=512",
    "data.eval_fraction=0.1",
    "drafter.block_size=8",
    "drafter.num_anchors=64",
    "drafter.max_anchors_per_doc=16",
    "drafter.loss_chunk_size=256",
    "train.lr=3e-3",
    "logging.log_every=20",
    "logging.progress=false",
    "train.compile=eager",
    "checkpoint.every=0",
]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def _python(*args: str, timeout: float | None = None) -> None:
    subprocess.run([sys.executable, *args], env=_env(), check=True, timeout=timeout)


def run_pipeline(work: str, num_rows: int = 240, max_new_tokens: int = 96, train_epochs: float = 4.0,
                 num_prompts: int = 12, eval_tokens: int = 64, world: int = 2, cache_dir: str | None = None,
                 extra_train: list[str] | None = None) -> dict:
    """regenerate -> torchrun train -> evaluate (trained and untrained); returns both eval reports."""
    cache = cache_dir or default_cache_dir()
    target = [f"target.path={LEARNED_TARGET}", f"target.cache_dir={cache}"]
    resolve_learned_target(cache)
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "regenerated.jsonl")
    _python("-m", "dflash_mp.regenerate", *target, f"data.max_rows={num_rows}", f"out={data}",
            f"max_new_tokens={max_new_tokens}", "batch_size=32")
    run_dir = os.path.join(work, "run")
    train = [*target, f"data.path={data}", f"run_dir={run_dir}", "topology.num_target_ranks=1",
             f"train.epochs={train_epochs}", *PIPELINE_TRAIN, *(extra_train or [])]
    _python("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m", "dflash_mp.main",
            *train)
    export = os.path.join(run_dir, "export")
    untrained = os.path.join(work, "untrained")
    _export_untrained(export, untrained)
    reports = {}
    for name, ckpt in (("trained", export), ("untrained", untrained)):
        out = os.path.join(work, f"eval_{name}.json")
        _python("-m", "dflash_mp.evaluate", f"checkpoint={ckpt}", *target, f"data.path={data}",
                "data.seq_len=512", "data.eval_fraction=0.1", f"eval.num_prompts={num_prompts}",
                f"eval.max_new_tokens={eval_tokens}", f"eval.out={out}")
        with open(out) as f:
            reports[name] = json.load(f)
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
    build = sub.add_parser("build-target", help="train (once) and cache the learned tiny Qwen3")
    build.add_argument("--out", default=None, help="directory to write (default: the cache entry)")
    pipe = sub.add_parser("pipeline", help="regenerate -> torchrun train -> evaluate")
    pipe.add_argument("--work", required=True)
    pipe.add_argument("--rows", type=int, default=240)
    pipe.add_argument("--epochs", type=float, default=4.0)
    pipe.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    if args.cmd == "build-target":
        print(train_learned_target(args.out) if args.out else resolve_learned_target())
        return
    reports = run_pipeline(args.work, num_rows=args.rows, train_epochs=args.epochs, world=args.world)
    for name, rep in reports.items():
        print(f"{name:>9}: tau_sim {rep['sim']['tau_sim']:.3f}  tau_sim_path {rep['sim']['tau_sim_path']:.3f}  "
              f"live tau {rep['live']['tau']:.3f}  lossless {rep['live']['lossless']}")


if __name__ == "__main__":
    main()
