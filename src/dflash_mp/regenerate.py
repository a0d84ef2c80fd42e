"""Rewrite a chat data set's assistant turns with the target's own responses.

A drafter learns to predict the target, so it should train on what the target itself says, not on
what some other model wrote (the DFlash recipe trains on target-regenerated data):

    python -m dflash_mp.regenerate target.path=Qwen/Qwen3-8B data.path=in.jsonl out=out.jsonl \
        [temperature=0] [max_new_tokens=1024] [batch_size=32] [seed=0]

`target.*` and `data.*` are the training job's own config fields (`data.max_rows`, `data.split`,
`target.dtype`, ...). Each assistant turn is generated from the conversation so far (with the turns
regenerated before it), rendered with the chat template and a generation prompt; conversations are
generated in batches with left padding. `temperature=0` is greedy; otherwise sampling is seeded per
batch, so an interrupted run resumed later writes the same rows as an uninterrupted one.

Resumable: rows already in `out` (matched by their non-assistant turns) are skipped and new rows are
appended, flushed after every batch. Output rows are `{"messages": [...]}`. Bad input rows are
counted by reason and skipped.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch

from .data.chat import row_messages

log = logging.getLogger(__name__)


@dataclass
class RegenConfig:
    out: str = ""  # output jsonl (appended to; rows already there are skipped)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling when temperature > 0
    max_new_tokens: int = 512  # per assistant turn
    batch_size: int = 16  # conversations generated together
    seed: int = 0  # sampling seed (per batch: seed + batch index)


def split_overrides(argv: list[str], own: type) -> tuple[dict[str, str], list[str]]:
    """`key=value` args for the dataclass `own` (bare field names, or `eval.` prefixed ones for the
    evaluator), and the rest for the job config."""
    from dataclasses import fields

    names = {f.name for f in fields(own)}
    mine, job = {}, []
    for arg in argv:
        key, eq, value = arg.partition("=")
        bare = key.split(".", 1)[1] if key.startswith("eval.") else key
        if eq and bare in names:
            mine[bare] = value
        else:
            job.append(arg)
    return mine, job


def build_own(own: type, values: dict[str, str]):
    from dataclasses import fields

    kinds = {f.name: f.type for f in fields(own)}
    out = {}
    for key, value in values.items():
        kind = kinds[key]
        try:
            out[key] = (float(value) if "float" in str(kind) else int(value) if "int" in str(kind) else value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a valid {kind}") from None
    return own(**out)


def conversation_key(messages: list[dict[str, str]]) -> str:
    """What regeneration leaves unchanged: the non-assistant turns and where the replies go."""
    return json.dumps([(m["role"], m["content"] if m["role"] != "assistant" else None) for m in messages])


def done_keys(path: str) -> Counter:
    """Keys of the rows already in `path`; a torn last line (a crash mid-write) is cut off first."""
    keys: Counter = Counter()
    if not os.path.exists(path):
        return keys
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
    for line in data[:end].splitlines():
        if line.strip():
            keys[conversation_key(json.loads(line)["messages"])] += 1
    return keys


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """End-of-turn ids: eos, the chat template's end marker (e.g. `<|im_end|>`), the model's eos ids."""
    from .data.chat import ChatEncoder

    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    marker = ChatEncoder(tokenizer).end_marker
    if marker:
        enc = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(enc) == 1:
            ids.add(enc[0])
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)


class Regenerator:
    def __init__(self, model, tokenizer, cfg: RegenConfig):
        self.model, self.tok, self.cfg = model, tokenizer, cfg
        self.device = model.get_input_embeddings().weight.device
        self.stop = stop_token_ids(tokenizer, model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop[0]

    @torch.no_grad()
    def generate(self, prompts: list[list[dict[str, str]]]) -> list[str]:
        """One reply per conversation prefix, generated as one left-padded batch."""
        ids = [self.tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] for t in ids]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)
        sample = self.cfg.temperature > 0
        kwargs = dict(do_sample=True, temperature=self.cfg.temperature, top_p=self.cfg.top_p) if sample \
            else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=self.cfg.max_new_tokens,
                                  eos_token_id=self.stop, pad_token_id=self.pad, **kwargs)
        return [self.tok.decode(row[width:], skip_special_tokens=True).strip() for row in out]

    def regenerate(self, conversations: list[list[dict[str, str]]]) -> list[list[dict[str, str]]]:
        """Every assistant turn replaced, turn by turn; each turn sees the replies regenerated before it."""
        convs = [list(c) for c in conversations]
        turn_idx = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
        for t in range(max(len(x) for x in turn_idx)):
            todo = [(c, x[t]) for c, x in zip(range(len(convs)), turn_idx) if t < len(x)]
            replies = self.generate([convs[c][:i] for c, i in todo])
            for (c, i), reply in zip(todo, replies):
                convs[c][i] = {"role": "assistant", "content": reply}
        return convs


def regenerate_file(job, cfg: RegenConfig) -> Counter:
    """Regenerate `job.data` into `cfg.out`; returns counters (written, skipped_done, bad/<reason>)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data.chat import BadRow, ChatEncoder, load_conversations
    from .target import resolve_dtype, resolve_path

    if not cfg.out:
        raise ValueError("out= is missing; name the output jsonl, e.g. out=regenerated.jsonl")
    if cfg.batch_size < 1 or cfg.max_new_tokens < 1:
        raise ValueError(f"batch_size={cfg.batch_size}, max_new_tokens={cfg.max_new_tokens}: both must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_path(job.target)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(job.target.dtype, device))
    model.to(device).eval()
    encoder = ChatEncoder(tok)
    stats: Counter = Counter()
    done = done_keys(cfg.out)
    todo = []
    for row in load_conversations(job.data):
        try:
            messages = row_messages(row, job.data.messages_field)
            encoder.encode_messages(messages)  # the trainer's own checks (template, rendering)
        except BadRow as bad:
            stats[f"bad/{bad.reason}"] += 1
            continue
        key = conversation_key(messages)
        if done[key] > 0:
            done[key] -= 1
            stats["skipped_done"] += 1
            continue
        todo.append(messages)
    regen = Regenerator(model, tok, cfg)
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    t0 = time.perf_counter()
    with open(cfg.out, "a", encoding="utf-8") as f:
        for b, start in enumerate(range(0, len(todo), cfg.batch_size)):
            # Seeded by the batch's place in the remaining work AND what was already done, so a
            # resumed run continues the uninterrupted run's seed sequence.
            torch.manual_seed(cfg.seed + stats["skipped_done"] + start)
            for conv in regen.regenerate(todo[start: start + cfg.batch_size]):
                stats["empty_replies"] += sum(m["role"] == "assistant" and not m["content"] for m in conv)
                f.write(json.dumps({"messages": conv}, ensure_ascii=False) + "\n")
                stats["written"] += 1
            f.flush()
            os.fsync(f.fileno())
            log.info("batch %d: %d/%d rows, %.1fs", b, stats["written"], len(todo), time.perf_counter() - t0)
    return stats


def main(argv: list[str] | None = None) -> None:
    from .config import compose

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(levelname)s %(name)s] %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    argv = sys.argv[1:] if argv is None else argv
    own, rest = split_overrides(argv, RegenConfig)
    cfg = build_own(RegenConfig, own)
    stats = regenerate_file(compose(rest), cfg)
    print(json.dumps(dict(stats), sort_keys=True))


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a user error: its message names the setting and the fix
        sys.exit(f"error: {e}")
