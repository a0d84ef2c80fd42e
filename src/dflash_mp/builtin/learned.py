"""A tiny target that knows something (the learning proof, proof.py, shows a drafter learns it).

`builtin:tiny-qwen3` is randomly initialised: its greedy output is noise, so a drafter trained on it
proves little about learning. `builtin:learned-qwen3` has the same shapes but is trained for about a
minute on CPU on chats built from text every CPython install ships (the first paragraph of the
docstrings of a fixed list of stdlib functions and classes, asked for as "What does `json.dumps`
do?"), mixed with the synthetic demo conversations. It is built once, deterministically (seeded),
and cached like the tiny target; the cache name carries a hash of the corpus, so a Python whose
docstrings differ gets its own copy.

    python -m dflash_mp.builtin build-learned [build_learned.size=medium] [build_learned.out=DIR]

Resolving `builtin:learned-qwen3` never trains: build it first (the command above, or the learning
proof, `python -m dflash_mp.builtin.proof`, which builds it).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import os
import random
import sys
import time

import torch

from ..fsutil import file_lock, write_atomic
from .chats import demo_data_path, demo_texts
from .names import cache_root
from .targets import TINY_QWEN3, build_demo_tokenizer, demo_qwen3_config

# Bump when the corpus recipe, the tokenizer, the shapes or the training recipe change.
LEARNED_VERSION = 1

# Shapes and training recipes. tiny: about a minute on a laptop CPU. medium: 39.4M parameters, the
# GPU run of the learning proof (BENCHMARKS.md, issue 3), its loss flat after ~500 steps.
SIZES = {
    "tiny": dict(shapes=TINY_QWEN3, num_steps=160, batch_size=8, seq_len=128, lr=3e-3),
    "medium": dict(shapes=dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4,
                               head_dim=64, intermediate_size=1536, max_position_embeddings=4096),
                   num_steps=1000, batch_size=32, seq_len=512, lr=1e-3),
}

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
    with open(demo_data_path(), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def corpus_hash(chats: list[dict]) -> str:
    h = hashlib.sha256(json.dumps(chats, sort_keys=True).encode())
    return h.hexdigest()[:10]


def learned_target_dir(cache_dir: str = "", size: str = "tiny") -> str:
    """Where the learned target of `size` is (or will be) built under the cache root."""
    cache = cache_root(cache_dir)
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


def build_learned_target(cache_dir: str = "", size: str = "tiny") -> str:
    """The cached learned target's directory, trained if it is not there yet (race-safe across
    processes). Called explicitly (`python -m dflash_mp.builtin build-learned`, the learning proof): resolving the name never trains."""
    out = learned_target_dir(cache_dir, size)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    with file_lock(out + ".lock"):  # one process trains it; the others wait, then read its copy
        if not os.path.isfile(os.path.join(out, "config.json")):
            train_learned_target(out, size=size)
    return out
