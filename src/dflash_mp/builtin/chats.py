"""The demo chats: procedural conversations a tiny model can learn, shipped as
`assets/demo_chat.jsonl` (`builtin:demo`, the default `data.path`). Nothing here touches the network.

    python -m dflash_mp.builtin make-data make_data.out=src/dflash_mp/assets/demo_chat.jsonl make_data.num=800
    python -m dflash_mp.builtin make-data make_data.out=/tmp/long_chat.jsonl make_data.num=400 make_data.turns=48
    (the second: 48-turn chats of 1.8k-2.3k tokens)
"""

from __future__ import annotations

import json
import random
from importlib import resources


def demo_data_path() -> str:
    return str(resources.files("dflash_mp").joinpath("assets/demo_chat.jsonl"))


def demo_texts(path: str | None = None) -> list[str]:
    """Every message content of the demo data set (the tokenizer's training corpus)."""
    with open(path or demo_data_path(), encoding="utf-8") as f:
        return [m["content"] for line in f for m in json.loads(line)["messages"]]


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
