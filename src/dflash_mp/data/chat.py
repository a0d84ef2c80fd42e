"""Chat conversations -> (input_ids, loss_mask) with the target tokenizer's own chat template.

The loss mask is found in character space: render the whole conversation once, locate each assistant
turn in the rendered text, then map characters to tokens with the fast tokenizer's offsets. Rendering
prefixes instead breaks on templates that rewrite earlier turns (Qwen3 drops `<think>` blocks of
assistant turns before the last user message), so a prefix render is not a prefix of the full one.

Messages follow the OpenAI/HF schema: besides `content`, an assistant turn may carry
`reasoning_content` and `tool_calls`, a `tool` turn a tool's result, and a row may carry `tools`
(the functions offered); all of it goes to the template as the served model would see it. What is
supervised: everything the model writes after the generation prompt (reasoning, answer, tool-call
text, end-of-turn token); never system, user or tool turns, nor what the generation prompt itself
holds (e.g. the empty think block Qwen3 inserts with thinking off).

A reply marked `"finished": false` (cut at `max_new_tokens` by `regenerate`) or whose `<think>` block
never closes was not ended by the model: `unfinished="drop"` skips the row, `"keep_open"` supervises
the reply without the closing tokens the template would add.

Bad rows raise `BadRow(reason)`; `tokenize_dataset` counts them by reason and drops them.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import re
from collections import Counter
from typing import TYPE_CHECKING, Any

import jinja2
import pyarrow as pa

if TYPE_CHECKING:
    import datasets

    from dflash_mp.data.stream import DataConfig

log = logging.getLogger(__name__)

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# Canonical roles, plus the ShareGPT spellings normalised onto them.
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "tool": "tool"}
# Column of the tolerant json reader: one raw JSON document per row, parsed (and judged) per row.
RAW_COLUMN = "_raw_json"
# datasets fingerprints a callable object by its state, not its class's code: without this, a
# cached tokenisation would survive a change to this file.
with open(__file__, "rb") as _f:
    _SOURCE_HASH = hashlib.sha256(_f.read()).hexdigest()


# Every reason a row can be skipped for (the keys of tokenize_dataset's Counter).
SKIP_REASONS = (
    "invalid_utf8", "invalid_json", "row_not_object", "missing_field",  # the row itself
    "not_a_list", "empty", "message_not_dict", "missing_role", "unknown_role", "content_not_string",
    "invalid_unicode", "no_assistant", "bad_tool_calls",  # its messages
    "unfinished_reply",  # a reply the model never ended (data.unfinished=drop)
    "template_error", "assistant_not_rendered", "no_supervised_tokens", "token_out_of_vocab",  # tokenisation
    "row_too_long",  # over data.max_row_chars: refused before it is parsed or tokenized
)
UNFINISHED = ("drop", "keep_open")
# What to do when a reason rejects rows (named in the error when no usable row is left).
SKIP_FIXES = {
    "invalid_utf8": "the file is not UTF-8 text (binary?): point data.path at a chat .jsonl",
    "invalid_json": "lines are not JSON: point data.path at a .jsonl with one JSON object per line",
    "row_not_object": "rows are not JSON objects: each line must be {\"messages\": [...]}",
    "missing_field": "rows have no 'messages' or 'conversations' field: set data.messages_field to the "
                     "column holding the conversation",
    "not_a_list": "the conversation field is not a list of messages: set data.messages_field",
    "empty": "conversations are empty lists",
    "message_not_dict": "messages are not {\"role\", \"content\"} objects",
    "missing_role": "messages have no 'role' (or ShareGPT 'from')",
    "unknown_role": f"roles must be one of {sorted(ROLES)}",
    "content_not_string": "message content is not a string",
    "invalid_unicode": "message content holds lone surrogates",
    "no_assistant": "no assistant reply with content (user turns only?): the drafter learns from the "
                    "target's replies; add them with `python -m dflash_mp.regenerate`",
    "template_error": "the target's chat template rejects the conversations (e.g. roles must alternate)",
    "assistant_not_rendered": "the chat template does not render the assistant replies as given",
    "no_supervised_tokens": "assistant replies render to no tokens",
    "token_out_of_vocab": "tokens fall outside the target's vocabulary: the tokenizer and target.path "
                          "disagree (use the target's own tokenizer)",
    "row_too_long": "rows are longer than data.max_row_chars: raise it (or 0 for no limit)",
    "unfinished_reply": "replies were cut off (regenerate's max_new_tokens): raise it and regenerate, or "
                        "set data.unfinished=keep_open",
}


class BadRow(Exception):
    """A conversation that cannot be trained on; `reason` is the counter key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _local_files(path: str) -> tuple[list[str], str]:
    if not os.path.exists(path):
        raise ValueError(f"data.path={path!r} does not exist; pass an existing .json/.jsonl/.parquet file "
                         "or directory, a hub dataset id, or 'builtin:demo'")
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names
                       if os.path.splitext(f)[1] in FORMATS)
        if not files:
            raise ValueError(f"data.path={path!r} is a directory with no .json/.jsonl/.parquet files: point "
                             "it at the data files or their directory")
    formats = {FORMATS.get(os.path.splitext(f)[1]) for f in files}
    if None in formats:
        raise ValueError(f"data.path={path!r} has an unknown extension; use .json, .jsonl or .parquet")
    if len(formats) > 1:
        raise ValueError(f"data.path={path!r} mixes json and parquet files; keep one format per "
                         "directory")
    return files, formats.pop()


def _unaddressable_fields(fields) -> bool:
    """True if a schema (or struct type) has, at any depth, a field name `datasets` cannot look up:
    empty, holding a NUL, or repeated (JSON keys such as "" or "\\u0000" load into Arrow but break
    column access later, in the middle of tokenizing)."""
    names = [f.name for f in fields]
    if len(set(names)) != len(names) or any(not n or "\x00" in n for n in names):
        return True
    for f in fields:
        t = f.type
        while pa.types.is_list(t) or pa.types.is_large_list(t):
            t = t.value_type
        if pa.types.is_struct(t) and _unaddressable_fields(list(t)):
            return True
    return False


def _read_json_tolerant(files: list[str]) -> datasets.Dataset:
    """One raw document per row, for json files whose rows do not share one Arrow schema."""
    import datasets

    docs: list[bytes] = []
    for name in files:
        with open(name, "rb") as f:
            raw = f.read()
        try:
            whole = json.loads(raw)
        except ValueError:  # JSON lines (or garbage): judge every line on its own
            docs += [line for line in raw.splitlines() if line.strip()]
            continue
        for doc in whole if isinstance(whole, list) else [whole]:
            docs.append(json.dumps(doc).encode())
    return datasets.Dataset.from_dict({RAW_COLUMN: docs})


def is_local(path: str) -> bool:
    """Whether `data.path` names local data (else a hub dataset id)."""
    return os.path.exists(path) or path.startswith((".", "/", "~")) \
        or os.path.splitext(path)[1] in FORMATS


def _no_rows(path: str) -> ValueError:
    return ValueError(f"data.path={path!r} holds no rows (an empty file?): point data.path at a chat "
                      ".jsonl with one {\"messages\": [...]} object per line")


def explain_skips(skipped: Counter) -> str:
    """`reason=count (fix)` for every reason that rejected rows, most frequent first."""
    return "; ".join(f"{reason}={n} ({SKIP_FIXES.get(reason, reason)})"
                     for reason, n in skipped.most_common())


def load_conversations(cfg: "DataConfig") -> datasets.Dataset:
    """The raw conversation rows named by `cfg.path` (local files or a hub id; `builtin:demo` is resolved
    to its file before it gets here, by dflash_mp.builtin).

    Local files form the "train" split; `cfg.split` may slice it ("train[:90%]").
    """
    import datasets  # half a second to import: only the ranks that read data pay it

    path = cfg.path
    local = is_local(path)
    if not local:
        ds = datasets.load_dataset(path, split=cfg.split)
    else:
        check_split(cfg)
        files, fmt = _local_files(os.path.expanduser(path))
        if all(os.path.getsize(f) == 0 for f in files):
            raise _no_rows(path)
        try:
            ds = datasets.load_dataset(fmt, data_files={"train": files}, split=cfg.split)
            if fmt == "json" and _unaddressable_fields(ds.data.schema):
                raise ValueError("field names that datasets cannot address")
        except (datasets.exceptions.DatasetGenerationError, ValueError, KeyError, StopIteration):
            # KeyError: datasets' own schema handling fails on some odd keys while loading;
            # StopIteration: its json reader on an empty first file
            if fmt != "json":
                raise
            # Rows with clashing types, broken lines or odd keys: judge each row separately.
            log.warning("%s: rows do not parse as one Arrow table; reading them one by one", path)
            ds = _read_json_tolerant(files)
    if len(ds) == 0:
        raise _no_rows(path)
    if cfg.max_rows:
        ds = ds.select(range(min(cfg.max_rows, len(ds))))
    return ds


def check_split(cfg: "DataConfig") -> None:
    """Local files hold one "train" split: checked from the config alone, before any process group."""
    if is_local(cfg.path) and not cfg.split.startswith("train"):
        raise ValueError(f"data.split={cfg.split!r}: local files only have a 'train' split "
                         "(slices such as 'train[:90%]' work)")


# ---------------------------------------------------------------------------------------------
# Tokenisation
# ---------------------------------------------------------------------------------------------


def _check_text(value) -> str:
    if not isinstance(value, str):
        raise BadRow("content_not_string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: the Rust tokenizer cannot take them
        raise BadRow("invalid_unicode") from None
    return value


def unclosed_think(text: str) -> bool:
    """True if `text` opens a `<think>` block it never closes (a reply cut while reasoning)."""
    return text.rfind("<think>") > text.rfind("</think>")


def normalize_messages(messages) -> list[dict[str, Any]]:
    """Validated `[{"role", "content", ...}]`; ShareGPT `from`/`value` mapped onto role/content.

    Kept besides role and content (when set): `reasoning_content` and `tool_calls` of assistant
    turns, `tool_call_id` and `name` of tool turns, and `finished` (False: a reply cut short).
    An assistant turn with tool calls or reasoning may have no content (None becomes "").
    Arrow merges row schemas, so absent keys come back as None: None counts as missing.
    """
    if not isinstance(messages, list):
        raise BadRow("not_a_list")
    if not messages:
        raise BadRow("empty")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise BadRow("message_not_dict")
        role = m["role"] if m.get("role") is not None else m.get("from")
        content = m["content"] if m.get("content") is not None else m.get("value")
        if role is None:
            raise BadRow("missing_role")
        if not isinstance(role, str) or role not in ROLES:
            raise BadRow("unknown_role")
        role = ROLES[role]
        msg: dict[str, Any] = {"role": role}
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
                raise BadRow("bad_tool_calls")
            if calls:
                msg["tool_calls"] = calls
            if m.get("reasoning_content") is not None:
                msg["reasoning_content"] = _check_text(m["reasoning_content"])
            if content is None and (calls or "reasoning_content" in msg):
                content = ""
            if m.get("finished") is not None:
                msg["finished"] = bool(m["finished"])
        elif role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    msg[key] = _check_text(m[key])
        msg["content"] = _check_text(content)
        out.append(msg)
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("reasoning_content", "").strip()
                                             or m.get("tool_calls")) for m in out):
        raise BadRow("no_assistant")
    return out


_SPACE = re.compile(r"\s*")


def _match_reply(text: str, start: int, full: str, answer: str, end_marker: str) -> int | None:
    """End of the reply rendered at `start` (after whitespace), or None if it is not there.

    Interpretations, in order: the reply verbatim; the reply with its reasoning re-rendered as a
    `<think>...</think>` block; the reply without its reasoning. One only counts when the turn's
    end marker (e.g. `<|im_end|>`) follows it, which rejects matches that run into other turns.
    """
    def closes_turn(end: int) -> bool:
        return text.startswith(end_marker, _SPACE.match(text, end).end())

    first = _SPACE.match(text, start).end()
    if full and text.startswith(full, first) and closes_turn(first + len(full)):
        return first + len(full)
    if not answer:
        return None
    if text.startswith("<think>", first):
        turn_end = text.find(end_marker, first) if end_marker else -1
        close = text.find("</think>", first, turn_end if turn_end >= 0 else len(text))
        pos = _SPACE.match(text, close + len("</think>")).end() if close >= 0 else -1
        if pos >= 0 and text.startswith(answer, pos) and closes_turn(pos + len(answer)):
            return pos + len(answer)
    if text.startswith(answer, first) and closes_turn(first + len(answer)):
        return first + len(answer)
    return None


def parse_row(row: dict) -> dict:
    """The row as a dict (a raw JSON line of the tolerant reader is parsed); raises `BadRow`."""
    if RAW_COLUMN in row:
        try:
            row = json.loads(row[RAW_COLUMN].decode("utf-8"))
        except UnicodeDecodeError:
            raise BadRow("invalid_utf8") from None
        except ValueError:
            raise BadRow("invalid_json") from None
        if not isinstance(row, dict):
            raise BadRow("row_not_object")
    return row


def raw_messages(row: dict, messages_field: str):
    """The conversation field of a data row, as stored (a raw JSON line is parsed first); raises
    `BadRow`. ShareGPT's `conversations` is read when `messages_field` is absent."""
    row = parse_row(row)
    for field in (messages_field, "conversations"):
        if row.get(field) is not None:
            return row[field]
    raise BadRow("missing_field")


def row_messages(row: dict, messages_field: str) -> list[dict[str, Any]]:
    """The normalised conversation of a data row; raises `BadRow`."""
    return normalize_messages(raw_messages(row, messages_field))


def row_tools(row: dict) -> list | None:
    """The row's `tools` (function schemas offered to the model), or None; raises `BadRow`."""
    tools = parse_row(row).get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRow("bad_tool_calls")
    return tools or None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as handed to the chat template: bookkeeping keys (`finished`) left out."""
    return [{k: v for k, v in m.items() if k != "finished"} for m in messages]


def is_unfinished(message: dict[str, Any]) -> bool:
    """An assistant reply its model never ended: cut by `max_new_tokens`, or reasoning left open."""
    return message["role"] == "assistant" and (
        message.get("finished") is False or unclosed_think(message["content"])
        or unclosed_think(message.get("reasoning_content", "")))


def render_chat(tokenizer, messages, chat_template_kwargs: dict | None = None,
                add_generation_prompt: bool = False, tools: list | None = None) -> str:
    """The template's text for `messages`: the one rendering training, `regenerate` and `evaluate`
    share, so all three see the conversation as the served model will."""
    return tokenizer.apply_chat_template(template_messages(messages), tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}))


class ChatEncoder:
    """Tokenizes conversations with `tokenizer`'s chat template; callable as a batched `Dataset.map`.

    `chat_template_kwargs` go to every `apply_chat_template` call (e.g. `{"enable_thinking": False}`);
    `unfinished` is what happens to replies their model never ended (`drop` | `keep_open`).
    """

    def __init__(self, tokenizer, vocab_limit: int | None = None, messages_field: str = "messages",
                 chat_template_kwargs: dict | None = None, unfinished: str = "drop", max_row_chars: int = 0):
        if not tokenizer.is_fast:
            raise ValueError(f"{type(tokenizer).__name__} is a slow tokenizer; the loss mask needs a fast "
                             "tokenizer's offset mapping (load it with use_fast=True)")
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template; use an instruct/chat tokenizer or set "
                             "tokenizer.chat_template")
        if unfinished not in UNFINISHED:
            raise ValueError(f"data.unfinished={unfinished!r}: use drop (skip rows with a cut-off reply) or "
                             "keep_open (supervise it without the end-of-turn token)")
        self.tokenizer = tokenizer
        self.vocab_limit = len(tokenizer) if vocab_limit is None else vocab_limit
        self.messages_field = messages_field
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.unfinished = unfinished
        self.header, self.end_marker, self.prompt_tail = self._assistant_markers()
        self.max_row_chars = max_row_chars  # 0: no limit
        self.special_ids = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special}

    def _render(self, messages, add_generation_prompt: bool = False, tools: list | None = None) -> str:
        return render_chat(self.tokenizer, messages, self.chat_template_kwargs, add_generation_prompt, tools)

    def _assistant_markers(self) -> tuple[str, str, str]:
        """What the template puts before an assistant reply (e.g. '<|im_start|>assistant\\n'), after it
        (e.g. '<|im_end|>'), and what a generation prompt adds past the header that the model then
        does not write (Qwen3 with thinking off: an empty '<think>\\n\\n</think>\\n\\n'), read off
        renders of a probe conversation."""
        probe = [{"role": "user", "content": "ping"}]
        plain, prompted = self._render(probe), self._render(probe, add_generation_prompt=True)
        opener = prompted[len(plain):] if prompted.startswith(plain) else ""
        # A generation prompt may open a reasoning block (DeepSeek-R1, Qwen3 with thinking off); past
        # turns do not carry it, so the header proper ends where that block starts.
        header = opener.split("<think>")[0]
        # A block the prompt also closes is the template's, not the model's: past turns rendered with
        # it must not supervise it. An open one is left in the span (the model writes its contents).
        tail = opener[len(header):]
        tail = tail if "</think>" in tail else ""
        replied = self._render(probe + [{"role": "assistant", "content": "PONG"}])
        return header, replied[replied.rfind("PONG") + len("PONG"):].strip(), tail

    def _assistant_spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int, bool]]:
        """Character spans `(start, end, closed)` of the assistant replies in `text`, found turn by
        turn, left to right; `closed` is False for a reply kept open (no end-of-turn token).

        With a header, a span runs from the end of the header (and of a closed think block the
        generation prompt puts there) to the end of the reply, and the reply must sit right after
        the header (whitespace aside): as given, or as rewritten by a Qwen3-style template, i.e.
        without its `<think>` block, or with it re-rendered as `<think>...</think>` before the answer
        (then inside the span). A turn with `reasoning_content` or `tool_calls` spans everything the
        template renders up to the turn's end marker, provided its answer is in there. Anchoring,
        rather than searching, keeps a reply from ever being matched inside a later turn. Templates
        without a header are searched forward.
        """
        spans, cursor = [], 0
        for m in messages:
            content = m["content"]
            if m["role"] != "assistant":
                key = content.strip()
                pos = text.find(key, cursor) if key else -1
                cursor = pos + len(key) if pos >= 0 else cursor  # templates may rewrite these; fine
                continue
            open_reply = is_unfinished(m)
            full, answer = content.strip(), content.split("</think>")[-1].strip()
            if not self.header:
                key = full if full in text[cursor:] else answer
                pos = text.find(key, cursor) if key else -1
                if pos < 0:
                    if key:
                        raise BadRow("assistant_not_rendered")
                    continue
                cursor = pos + len(key)
                spans.append((pos, cursor, not open_reply))
                continue
            h = text.find(self.header, cursor)
            if h < 0:
                raise BadRow("assistant_not_rendered")
            start = cursor = h + len(self.header)  # consumed even if this reply is skipped
            if self.prompt_tail and text.startswith(self.prompt_tail, start):
                start += len(self.prompt_tail)
            turn_end = text.find(self.end_marker, start) if self.end_marker else -1
            turn_end = turn_end if turn_end >= 0 else len(text)
            if open_reply:
                # Up to the last thing the model wrote; not the `</think>` or end marker the template
                # adds after it. A cut reply inlining an open `<think>` may follow an empty block the
                # template made up: the span starts at the reply itself.
                pieces = [p for p in (full, m.get("reasoning_content", "").strip()) if p]
                pos = text.rfind(pieces[0], start, turn_end) if pieces else -1
                if pos < 0:
                    if pieces:
                        raise BadRow("assistant_not_rendered")
                    continue
                lo = pos if unclosed_think(full) else start
                cursor = pos + len(pieces[0])
                spans.append((lo, cursor, False))
                continue
            if "reasoning_content" in m or "tool_calls" in m:
                if answer and answer not in text[start:turn_end]:
                    raise BadRow("assistant_not_rendered")
                end = start + len(text[start:turn_end].rstrip())
                if end > _SPACE.match(text, start).end():
                    spans.append((start, end, True))
                cursor = end
                continue
            end = _match_reply(text, start, full, answer, self.end_marker)
            if end is None:
                if answer:
                    raise BadRow("assistant_not_rendered")
                continue  # only reasoning, which the template dropped: nothing to supervise
            cursor = end
            spans.append((start, end, True))
        return spans

    def encode_messages(self, messages, tools: list | None = None) -> tuple[list[int], list[int]]:
        messages = normalize_messages(messages)
        if self.unfinished == "drop" and any(is_unfinished(m) for m in messages):
            raise BadRow("unfinished_reply")
        try:
            text = self._render(messages, tools=tools)
        except (jinja2.TemplateError, TypeError, ValueError):  # e.g. "roles must alternate"
            raise BadRow("template_error") from None
        spans = self._assistant_spans(messages, text)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        starts = [s for s, _ in offsets]
        mask = [0] * len(ids)
        for s, e, closed in spans:
            lo, hi = bisect.bisect_left(starts, s), bisect.bisect_left(starts, e)
            # The end-of-turn token is what makes the model stop: supervise it (and any whitespace
            # the template put between the reply and it), not the newline that follows. A reply
            # kept open never produced one.
            j = hi
            while closed and j < len(ids) and ids[j] not in self.special_ids \
                    and not text[slice(*offsets[j])].strip():
                j += 1
            if closed and j < len(ids) and ids[j] in self.special_ids:
                hi = j + 1
            mask[lo:hi] = [1] * (hi - lo)
        if not any(mask):
            raise BadRow("no_supervised_tokens")
        if max(ids) >= self.vocab_limit:
            raise BadRow("token_out_of_vocab")
        return ids, mask

    def encode_row(self, row: dict) -> tuple[list[int], list[int]]:
        limit = self.max_row_chars
        if limit and RAW_COLUMN in row and len(row[RAW_COLUMN]) > limit:  # before parsing it
            raise BadRow("row_too_long")
        messages = raw_messages(row, self.messages_field)
        if limit and isinstance(messages, list) and _text_chars(messages) > limit:  # before rendering it
            raise BadRow("row_too_long")
        return self.encode_messages(messages, tools=row_tools(row))

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "skip_reason": []}
        for i in range(len(next(iter(batch.values())))):
            try:
                ids, mask = self.encode_row({k: v[i] for k, v in batch.items()})
                reason = ""
            except BadRow as bad:
                ids, mask, reason = [], [], bad.reason
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["skip_reason"].append(reason)
        return out


def _text_chars(messages: list) -> int:
    total = 0
    for m in messages:
        if isinstance(m, dict):
            for key in ("content", "value"):
                if isinstance(m.get(key), str):
                    total += len(m[key])
    return total


def tokenize_conversation(tokenizer, messages, vocab_limit: int | None = None, tools: list | None = None,
                          **encoder_kwargs) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one conversation; raises `BadRow`. Builds a `ChatEncoder` per call:
    use one `ChatEncoder` for many conversations."""
    return ChatEncoder(tokenizer, vocab_limit, **encoder_kwargs).encode_messages(messages, tools=tools)


def _kept(reasons: list[str]) -> list[bool]:
    return [not r for r in reasons]


def tokenize_dataset(ds: datasets.Dataset, tokenizer, cfg: "DataConfig",
                     vocab_limit: int | None = None) -> tuple[datasets.Dataset, Counter]:
    """Tokenized rows (`input_ids`, `loss_mask`) and a Counter of skipped rows by reason.

    `vocab_limit` is the number of embedding rows of the target (default: `len(tokenizer)`).
    """
    import datasets
    from datasets.fingerprint import Hasher

    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "skip_reason": datasets.Value("string"),
    })
    encoder = ChatEncoder(tokenizer, vocab_limit, cfg.messages_field, cfg.chat_template_kwargs, cfg.unfinished,
                          cfg.max_row_chars)
    num_proc = cfg.num_proc if cfg.num_proc > 1 else None
    fingerprint = Hasher.hash([ds._fingerprint, _SOURCE_HASH, encoder])
    out = ds.map(encoder, batched=True, batch_size=256, remove_columns=ds.column_names,
                 features=features, num_proc=num_proc, new_fingerprint=fingerprint, desc="tokenize")
    skipped = Counter(r for r in out["skip_reason"] if r)
    if skipped:
        out = out.filter(_kept, batched=True, input_columns=["skip_reason"])
    return out.remove_columns("skip_reason"), skipped
