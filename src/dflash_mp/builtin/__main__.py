"""`python -m dflash_mp.builtin make-data|build-target`: the demo assets, written by hand.

    python -m dflash_mp.builtin make-data --out src/dflash_mp/assets/demo_chat.jsonl --num 800 --seed 0
    python -m dflash_mp.builtin make-data --out /tmp/long_chat.jsonl --num 400 --turns 48  # 1.8k-2.3k tokens
    python -m dflash_mp.builtin build-target --out /tmp/tiny-qwen3
"""

from __future__ import annotations

import argparse

from .chats import demo_data_path, demo_texts, write_demo_data
from .targets import build_demo_target, build_demo_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_mp.builtin",
                                     description="write the demo chats or build the tiny target")
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
