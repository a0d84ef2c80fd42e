"""`python -m dflash_mp.builtin make-data|build-target|build-learned`: the builtin assets, built by hand.

    python -m dflash_mp.builtin make-data make_data.out=src/dflash_mp/assets/demo_chat.jsonl make_data.num=800
    python -m dflash_mp.builtin make-data make_data.out=/tmp/long_chat.jsonl make_data.num=400 make_data.turns=48
    python -m dflash_mp.builtin build-target build_target.out=/tmp/tiny-qwen3
    python -m dflash_mp.builtin build-learned [build_learned.size=medium]  # cached: builtin:learned-qwen3[-medium]

Each command has a node of its own (`make_data.*`, `build_target.*`, `build_learned.*`) and reads no
job config; `python -m dflash_mp.builtin COMMAND --help` lists its options.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from ..cli import commands_main, entry
from .chats import demo_data_path, demo_texts, write_demo_data
from .learned import SIZES, build_learned_target, train_learned_target
from .targets import build_demo_target, build_demo_tokenizer


@dataclass
class MakeDataConfig:
    out: str = ""  # jsonl file to write; empty = the shipped asset (src/dflash_mp/assets/demo_chat.jsonl)
    num: int = 800  # conversations
    seed: int = 0  # of the generator: the same seed writes the same file
    turns: int = 1  # user/assistant turns per conversation; 1 = the shipped short chats (1-3 tasks)


@dataclass
class BuildTargetConfig:
    out: str = MISSING  # directory to write the tiny Qwen3 target and its tokenizer to
    seed: int = 0  # of its random weights


@dataclass
class BuildLearnedConfig:
    size: str = "tiny"  # tiny (about a minute on a CPU) or medium (a GPU run)
    out: str = ""  # directory to write; empty = its entry in the cache (what builtin:learned-qwen3* names)
    cache_dir: str = ""  # cache root; empty = $DFLASH_MP_CACHE, else ~/.cache/dflash_mp


def make_data(opts: MakeDataConfig) -> str:
    if opts.turns < 1:
        raise ValueError(f"make_data.turns={opts.turns}: use 1 (the short chats) or more.")
    out = opts.out or demo_data_path()
    write_demo_data(out, opts.num, opts.seed, opts.turns)
    return out


def build_target(opts: BuildTargetConfig) -> str:
    return build_demo_target(opts.out, build_demo_tokenizer(demo_texts()), seed=opts.seed)


def build_learned(opts: BuildLearnedConfig) -> str:
    if opts.size not in SIZES:
        raise ValueError(f"build_learned.size={opts.size!r} is not a size; use one of {', '.join(SIZES)}.")
    if opts.out:
        return train_learned_target(opts.out, size=opts.size)
    return build_learned_target(opts.cache_dir, size=opts.size)


def main(argv: list[str] | None = None) -> str | None:
    # The run functions are looked up here, at call time, so a test can stand in for one.
    commands = {"make-data": ("make_data", MakeDataConfig, make_data, "Write the synthetic chat data set (jsonl)."),
                "build-target": ("build_target", BuildTargetConfig, build_target,
                                 "Build the tiny Qwen3 target and its tokenizer."),
                "build-learned": ("build_learned", BuildLearnedConfig, build_learned,
                                  "Train (once) and cache a learned Qwen3 target.")}
    out = commands_main("python -m dflash_mp.builtin", commands, __doc__, argv)
    if out is not None:
        print(out)
    return out


if __name__ == "__main__":
    entry(main)
