"""Assets for the laptop-CPU default run: a synthetic chat data set, a locally trained tokenizer and a
tiny Qwen3 target built from a config. Nothing here touches the network.

    python -m dflash_mp.demo make-data --out src/dflash_mp/assets/demo_chat.jsonl --num 800 --seed 0
    python -m dflash_mp.demo make-data --out /tmp/long_chat.jsonl --num 400 --turns 48  # 1.8k-2.3k tokens
    python -m dflash_mp.demo build-target --out /tmp/tiny-qwen3

`builtin:random-qwen3-8b` (and `builtin:random-tiny-qwen3`, its CPU-test stand-in) is a target with
real shapes and random weights that are never stored: the cached directory holds config.json, the demo
tokenizer and `random_init.json` (a seed), and `target.TargetWorker.load` draws the weights on the
target device at load time. Realistic-shape GPU benchmarks of the whole pipeline need no download.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from importlib import resources
from typing import TYPE_CHECKING

import torch

from .fsutil import write_atomic

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# transformers is imported inside the builders: the data pipeline imports this module for the asset
# path and should not pay for loading the model zoo (seconds per process).

BUILTIN_DATA = "builtin:demo"
BUILTIN_TARGET = "builtin:tiny-qwen3"
# Same shapes, trained briefly on stdlib docstrings + the demo chats (see learned.py).
BUILTIN_LEARNED_TARGET = "builtin:learned-qwen3"
BUILTIN_LEARNED_MEDIUM = "builtin:learned-qwen3-medium"  # ~38M parameters, trained on a GPU
# Random-weight targets -> the hub target whose shapes they copy (plan.TARGET_ARCHS, or the
# architecture itself for target_archs.HF_ARCHS / TINY_ARCHS); None = TINY_QWEN3.
RANDOM_TARGETS = {"builtin:random-qwen3-8b": "Qwen/Qwen3-8B", "builtin:random-tiny-qwen3": None,
                  "builtin:random-qwen3.5-27b": "Qwen/Qwen3.5-27B",
                  "builtin:random-qwen3.5-35b-a3b": "Qwen/Qwen3.5-35B-A3B",
                  "builtin:random-qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
                  "builtin:random-tiny-qwen3.5": "tiny-qwen3.5"}
BUILTIN_TARGETS = (BUILTIN_TARGET, BUILTIN_LEARNED_TARGET, BUILTIN_LEARNED_MEDIUM, *RANDOM_TARGETS)
# Bump when the tokenizer, the target or the data change, so stale caches are not reused.
DEMO_VERSION = 1

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TINY_QWEN3 = dict(
    hidden_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    max_position_embeddings=4096,
)


def demo_data_path() -> str:
    return str(resources.files("dflash_mp").joinpath("assets/demo_chat.jsonl"))


def demo_texts(path: str | None = None) -> list[str]:
    """Every message content of the demo data set (the tokenizer's training corpus)."""
    with open(path or demo_data_path(), encoding="utf-8") as f:
        return [m["content"] for line in f for m in json.loads(line)["messages"]]


# ---------------------------------------------------------------------------------------------
# Tokenizer and target
# ---------------------------------------------------------------------------------------------


def build_demo_tokenizer(texts: list[str], vocab_size: int = 1536) -> "PreTrainedTokenizerFast":
    """Byte-level BPE trained on `texts`, with ChatML special tokens and a Qwen-style template.

    Byte-level so that any string round-trips (bad-row tests feed it arbitrary unicode).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts + ["system", "user", "assistant"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def demo_qwen3_config(tokenizer, **sizes):
    """Qwen3Config of TINY_QWEN3 overridden by `sizes`, with `tokenizer`'s special ids and untied
    embeddings. The default vocab has spare rows past the tokenizer (like Qwen3) so a drafter can use
    one as its mask token."""
    from transformers import Qwen3Config

    # rope_theta is an argument that transformers 5 folds into rope_parameters (no attribute of that name).
    unknown = sorted(k for k in sizes if k != "rope_theta" and not hasattr(Qwen3Config(), k))
    if unknown:
        raise ValueError(f"unknown Qwen3Config fields {unknown}; pass fields such as {sorted(TINY_QWEN3)}")
    vocab_size = math.ceil((len(tokenizer) + 8) / 64) * 64
    fields = {"vocab_size": vocab_size, **TINY_QWEN3, "tie_word_embeddings": False, **sizes}
    return Qwen3Config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=None, **fields)


def build_demo_target(out_dir: str, tokenizer, seed: int = 0, **sizes) -> str:
    """Write a randomly initialised tiny Qwen3 plus `tokenizer` to `out_dir` (atomically); returns it."""
    from transformers import AutoModelForCausalLM

    config = demo_qwen3_config(tokenizer, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)

    def save(tmp: str) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_atomic(out_dir, save)


def build_random_target(out_dir: str, tokenizer, seed: int = 0, **sizes) -> str:
    """Write config.json, `tokenizer` and the random-init marker, no weights, to `out_dir` (atomically).

    Weights of 8B shapes take seconds to draw on a GPU but minutes to write and read back, so they are
    drawn at load time instead (target.TargetWorker.load, target.load_target_head).
    """
    from .target import RANDOM_INIT

    config = demo_qwen3_config(tokenizer, **sizes)

    def save(tmp: str) -> None:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, RANDOM_INIT), "w") as f:
            json.dump({"seed": seed}, f)

    return write_atomic(out_dir, save)


def build_random_arch_target(out_dir: str, tokenizer, fields: dict, seed: int = 0) -> str:
    """`build_random_target` for an architecture of target_archs (hybrid, MoE): its own config class,
    the demo tokenizer's special ids, and the demo vocabulary where `fields` name none (tiny ones)."""
    from .target import RANDOM_INIT
    from .target_archs import hf_config

    vocab_size = fields.get("vocab_size") or math.ceil((len(tokenizer) + 8) / 64) * 64
    config = hf_config(fields, vocab_size=vocab_size, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=None)

    def save(tmp: str) -> None:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, RANDOM_INIT), "w") as f:
            json.dump({"seed": seed}, f)

    return write_atomic(out_dir, save)


def default_cache_dir() -> str:
    return os.environ.get("DFLASH_MP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dflash_mp"))


def resolve_target_path(path: str, cache_dir: str | None = None) -> str:
    """Map a builtin target (BUILTIN_TARGETS) to a built (once, cached) local directory; other values
    pass through.

    Safe when several ranks race: each builds privately and renames; a complete directory is never
    visible half-written, so "config.json exists" means "ready".
    """
    if path in (BUILTIN_LEARNED_TARGET, BUILTIN_LEARNED_MEDIUM):
        from .learned import resolve_learned_target

        return resolve_learned_target(cache_dir, "medium" if path == BUILTIN_LEARNED_MEDIUM else "tiny")
    if not path.startswith("builtin:"):
        return path
    if path not in BUILTIN_TARGETS:
        raise ValueError(f"unknown builtin target {path!r}; the builtins are {', '.join(BUILTIN_TARGETS)}")
    out = os.path.join(cache_dir or default_cache_dir(), f"{path.removeprefix('builtin:')}-v{DEMO_VERSION}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tokenizer = build_demo_tokenizer(demo_texts())
    if path == BUILTIN_TARGET:
        return build_demo_target(out, tokenizer)
    from .plan import known_target_config
    from .target_archs import HF_ARCHS, TINY_ARCHS

    hub_id = RANDOM_TARGETS[path]
    if hub_id in HF_ARCHS or hub_id in TINY_ARCHS:
        return build_random_arch_target(out, tokenizer, HF_ARCHS.get(hub_id) or TINY_ARCHS[hub_id])
    return build_random_target(out, tokenizer, **(known_target_config(hub_id) if hub_id else {}))


# ---------------------------------------------------------------------------------------------
# Synthetic conversations: procedural, predictable tasks a tiny model can pick up.
# ---------------------------------------------------------------------------------------------

NAMES = ["Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lina", "Ben", "Ivy", "Sam", "Nora", "Eli"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "coins"]
WORDS = [
    "garden", "planet", "window", "rocket", "yellow", "basket", "silver", "dragon", "pencil",
    "forest", "castle", "monkey", "bridge", "candle", "island", "orange", "winter", "button",
    "cactus", "piano", "tiger", "river", "cloud", "lemon", "robot", "zebra", "house", "train",
]
UNITS = [  # (large unit, small unit, small units per large unit)
    ("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("liters", "milliliters", 1000),
    ("days", "hours", 24), ("weeks", "days", 7), ("feet", "inches", 12),
]
ANIMALS = {  # singular: (plural, legs)
    "spider": ("spiders", 8), "dog": ("dogs", 4), "cat": ("cats", 4), "bird": ("birds", 2),
    "ant": ("ants", 6), "horse": ("horses", 4), "duck": ("ducks", 2), "beetle": ("beetles", 6),
}
MIXES = {("red", "blue"): "purple", ("blue", "yellow"): "green", ("red", "yellow"): "orange",
         ("red", "white"): "pink", ("black", "white"): "gray"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SYSTEMS = ["You are a helpful assistant.", "You are a patient math tutor. Show your steps.",
           "Answer briefly and clearly.", "You are a friendly assistant for kids."]


def _word_problem(r: random.Random):
    name, item = r.choice(NAMES), r.choice(ITEMS)
    if r.random() < 0.5:
        a, b = r.randint(3, 20), r.randint(2, 15)
        c = r.randint(1, a + b - 1)
        q = f"{name} has {a} {item}. {name} gets {b} more and then gives {c} away. How many {item} are left?"
        ans = a + b - c
        return q, (f"{name} starts with {a} {item}.\nAfter getting {b} more: {a} + {b} = {a + b}.\n"
                   f"After giving {c} away: {a + b} - {c} = {ans}.\nAnswer: {ans}"), ans
    k, m = r.randint(2, 9), r.randint(2, 12)
    q = f"{name} buys {k} boxes of {item}. Each box holds {m}. How many {item} is that in total?"
    return q, f"{k} boxes x {m} {item} per box = {k * m} {item}.\nAnswer: {k * m}", k * m


def _addition(r: random.Random):
    a, b = r.randint(11, 89), r.randint(11, 89)
    tens, ones = (a // 10 + b // 10) * 10, a % 10 + b % 10
    return (f"What is {a} + {b}?",
            f"{a // 10 * 10} + {b // 10 * 10} = {tens}, {a % 10} + {b % 10} = {ones}, "
            f"{tens} + {ones} = {a + b}.\nSo {a} + {b} = {a + b}.", a + b)


def _conversion(r: random.Random):
    big, small, f = r.choice(UNITS)
    x = r.randint(2, 12)
    if r.random() < 0.5:
        return (f"Convert {x} {big} to {small}.",
                f"There are {f} {small} in one {big[:-1]}.\n"
                f"So {x} {big} = {x} x {f} = {x * f} {small}.", x * f)
    return (f"How many {big} are {x * f} {small}?",
            f"There are {f} {small} in one {big[:-1]}.\n{x * f} / {f} = {x}, so it is {x} {big}.", x)


def _sorting(r: random.Random):
    if r.random() < 0.6:
        nums = r.sample(range(1, 100), r.randint(4, 7))
        desc = r.random() < 0.3
        order = "descending" if desc else "ascending"
        out = sorted(nums, reverse=desc)
        return (f"Sort these numbers in {order} order: {', '.join(map(str, nums))}",
                f"In {order} order: {', '.join(map(str, out))}.", None)
    words = r.sample(WORDS, r.randint(3, 6))
    return (f"Put these words in alphabetical order: {', '.join(words)}",
            f"Alphabetical order: {', '.join(sorted(words))}.", None)


def _backwards(r: random.Random):
    w = r.choice(WORDS)
    return (f"Spell the word '{w}' backwards.",
            f"Letters: {'-'.join(w)}.\nReversed: {'-'.join(w[::-1])}.\n"
            f"So '{w}' backwards is '{w[::-1]}'.", None)


def _facts(r: random.Random):
    kind = r.randint(0, 2)
    if kind == 0:
        (a1, (p1, l1)), (a2, (p2, l2)) = r.sample(sorted(ANIMALS.items()), 2)
        k1, k2 = r.randint(1, 6), r.randint(1, 6)
        return (f"How many legs do {k1} {p1} and {k2} {p2} have together?",
                f"A {a1} has {l1} legs: {k1} x {l1} = {k1 * l1}.\n"
                f"A {a2} has {l2} legs: {k2} x {l2} = {k2 * l2}.\n"
                f"Together: {k1 * l1} + {k2 * l2} = {k1 * l1 + k2 * l2} legs.", k1 * l1 + k2 * l2)
    if kind == 1:
        (c1, c2), mixed = r.choice(sorted(MIXES.items()))
        return (f"What color do you get when you mix {c1} and {c2}?",
                f"Mixing {c1} and {c2} gives {mixed}.", None)
    start, n = r.randrange(7), r.randint(1, 6)
    steps = ", ".join(f"{DAYS[(start + i) % 7]} ({i})" for i in range(1, n + 1))
    return (f"What day comes {n} days after {DAYS[start]}?",
            f"Counting forward from {DAYS[start]}: {steps}.\nThe answer is {DAYS[(start + n) % 7]}.", None)


def _counting(r: random.Random):
    w = r.choice(WORDS)
    letter = r.choice(sorted(set(w)))
    n = w.count(letter)
    return (f"How many times does the letter '{letter}' appear in '{w}'?",
            f"Letters: {'-'.join(w)}.\nThe letter '{letter}' appears {n} time{'s' if n != 1 else ''}.", n)


TASKS = [_word_problem, _addition, _conversion, _sorting, _backwards, _facts, _counting]


def make_conversation(r: random.Random) -> dict:
    messages = []
    if r.random() < 0.4:
        messages.append({"role": "system", "content": r.choice(SYSTEMS)})
    if r.random() < 0.15:
        messages += [{"role": "user", "content": r.choice(["Hi!", "Hello.", "Hey there."])},
                     {"role": "assistant", "content": "Hello! What would you like to work on?"}]
    for _ in range(r.choice([1, 1, 2, 2, 3])):
        q, a, value = r.choice(TASKS)(r)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if value is not None and r.random() < 0.25:
            messages += [{"role": "user", "content": "Now double that number."},
                         {"role": "assistant", "content": f"{value} x 2 = {2 * value}."}]
    return {"messages": messages}


def make_long_conversation(r: random.Random, turns: int) -> dict:
    """Exactly `turns` user/assistant turns from the same generators as `make_conversation`: a few
    such documents fill a packed row of thousands of tokens, as real long chats do."""
    messages = [{"role": "system", "content": r.choice(SYSTEMS)}] if r.random() < 0.4 else []
    pairs = [(r.choice(["Hi!", "Hello.", "Hey there."]), "Hello! What would you like to work on?")] \
        if r.random() < 0.15 else []
    while len(pairs) < turns:
        q, a, value = r.choice(TASKS)(r)
        pairs.append((q, a))
        if value is not None and r.random() < 0.25:
            pairs.append(("Now double that number.", f"{value} x 2 = {2 * value}."))
    for q, a in pairs[:turns]:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages}


def write_demo_data(out: str, num: int, seed: int, turns: int = 1) -> None:
    """`num` conversations; turns=1 gives the shipped asset's short chats (1 to 3 tasks), turns > 1
    conversations of exactly that many user/assistant turns."""
    if turns < 1:
        raise ValueError(f"turns={turns}: use 1 (short chats) or more.")
    r = random.Random(seed)
    with open(out, "w", encoding="utf-8") as f:
        for _ in range(num):
            row = make_conversation(r) if turns == 1 else make_long_conversation(r, turns)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_mp.demo")
    sub = parser.add_subparsers(dest="cmd", required=True)
    data = sub.add_parser("make-data", help="write the synthetic chat data set (jsonl)")
    data.add_argument("--out", default=demo_data_path())
    data.add_argument("--num", type=int, default=800)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--turns", type=int, default=1,
                      help="user/assistant turns per conversation; 1 = the shipped short chats (1-3 tasks)")
    target = sub.add_parser("build-target", help="build the tiny Qwen3 target + tokenizer")
    target.add_argument("--out", required=True)
    target.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd == "make-data":
        write_demo_data(args.out, args.num, args.seed, args.turns)
    else:
        build_demo_target(args.out, build_demo_tokenizer(demo_texts()), seed=args.seed)
    print(args.out)


if __name__ == "__main__":
    main()
