"""`python -m dflash_mp.builtin make-data|build-target|build-learned`: the builtin assets, built by hand.

    python -m dflash_mp.builtin make-data --out src/dflash_mp/assets/demo_chat.jsonl --num 800 --seed 0
    python -m dflash_mp.builtin make-data --out /tmp/long_chat.jsonl --num 400 --turns 48  # 1.8k-2.3k tokens
    python -m dflash_mp.builtin build-target --out /tmp/tiny-qwen3
    python -m dflash_mp.builtin build-learned [--size medium]   # into the cache: builtin:learned-qwen3[-medium]
"""

from __future__ import annotations

import argparse

from .chats import demo_data_path, demo_texts, write_demo_data
from .learned import SIZES, build_learned_target, train_learned_target
from .targets import build_demo_target, build_demo_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_mp.builtin",
                                     description="write the demo chats, build the tiny target or train a learned one")
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
    learned = sub.add_parser("build-learned", help="train (once) and cache a learned Qwen3 target")
    learned.add_argument("--size", default="tiny", choices=sorted(SIZES))
    learned.add_argument("--out", default=None, help="directory to write (default: its entry in the cache)")
    learned.add_argument("--cache-dir", default="", help="cache root (default: $DFLASH_MP_CACHE or ~/.cache/dflash_mp)")
    args = parser.parse_args(argv)
    if args.cmd == "make-data":
        write_demo_data(args.out, args.num, args.seed, args.turns)
    elif args.cmd == "build-target":
        build_demo_target(args.out, build_demo_tokenizer(demo_texts()), seed=args.seed)
    elif args.out:
        args.out = train_learned_target(args.out, size=args.size)
    else:
        args.out = build_learned_target(args.cache_dir, size=args.size)
    print(args.out)


if __name__ == "__main__":
    main()
