"""The fastest Triton variant of a tile sweep's JSON, for bench/run_tiles_h200.sh to time in the whole
step or forward next:

    python bench/pick_tiles.py doc  $OUT/doc_attn_tiles.json     # -> e.g. m64n64w4s3 (target_forward's @ suffix)
    python bench/pick_tiles.py drafter $OUT/flex_tiles_qwen3_8b.json  # -> e.g. triton-pairq-s2 (a +btiles= name)

Only variants that ran and differ from the default are picked from (doc: the kernel's time per layer;
drafter: forward + backward per layer); prints nothing where none ran."""

from __future__ import annotations

import json
import sys


def main() -> None:
    kind, path = sys.argv[1], sys.argv[2]
    variants = [v for v in json.load(open(path))["variants"] if "error" not in v]
    if kind == "doc":
        ran = [(v["ms"], v["variant"].removeprefix("triton-")) for v in variants
               if v["variant"].startswith("triton-m") and not v["variant"].endswith(("-ptr", "-tma"))]
    elif kind == "drafter":
        ran = [(v["fwd_bwd_ms"], v["variant"]) for v in variants
               if v["variant"].startswith("triton-") and not v["variant"].endswith("-ptr")]
    else:
        raise SystemExit(f"pick_tiles.py: kind {kind!r}: use doc or drafter")
    if ran:
        print(min(ran)[1])


if __name__ == "__main__":
    main()
