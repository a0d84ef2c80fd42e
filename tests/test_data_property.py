"""Property tests: malformed rows never crash the pipeline, and what comes out is always valid."""

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dflash_mp.data import (
    BadRow,
    ChatEncoder,
    DataConfig,
    ShardStream,
    check_batch,
    load_conversations,
    normalize_messages,
    pack_rows,
    plan_batches,
    tokenize_dataset,
)
from dflash_mp.data.chat import SKIP_REASONS, is_unfinished, unclosed_think
from dflash_mp.builtin import build_demo_tokenizer, demo_texts
from test_chat import THINK_TEMPLATE

T = 64
END = "<|im_end|>"
TRICKY = ["<|im_end|>", "<|im_start|>assistant\n", "<|im_start|>", "<|endoftext|>", "<think>", "</think>",
          "\n", "  ", "user", "assistant", "héllo", "日本", "🎉"]

text = st.one_of(
    st.text(max_size=30),
    st.lists(st.one_of(st.sampled_from(TRICKY), st.text(max_size=4)), max_size=6).map("".join),
)
surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2)
junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
roles = st.sampled_from(["system", "user", "assistant", "human", "gpt", "tool"])
message = st.one_of(
    st.fixed_dictionaries({"role": roles, "content": text}),
    st.fixed_dictionaries({"from": roles, "value": text}),
    st.fixed_dictionaries({"role": st.one_of(roles, st.sampled_from(["narrator", ""]), junk),
                           "content": st.one_of(text, surrogates.map(lambda s: "x" + s), junk)}),
    junk,
)


def turns_to_messages(turns):
    return [{"role": role, "content": c} for pair in turns for role, c in zip(("user", "assistant"), pair)]


chat = st.lists(st.tuples(text, text), min_size=1, max_size=3).map(turns_to_messages)
huge = st.tuples(text, st.text(min_size=1, max_size=8), st.integers(20, 120)).map(
    lambda t: [{"role": "user", "content": t[0]}, {"role": "assistant", "content": t[1] * t[2]}])
row = st.one_of(
    st.fixed_dictionaries({"messages": st.one_of(chat, huge, st.lists(message, max_size=5), junk)}),
    st.fixed_dictionaries({"conversations": st.lists(message, max_size=5)}),
    st.dictionaries(st.text(max_size=4), junk, max_size=2),
)


@pytest.fixture(scope="module")
def encoder():
    return ChatEncoder(build_demo_tokenizer(demo_texts()))


def masked_runs(tok, ids, mask):
    """Decoded text of every maximal run of supervised tokens."""
    runs, cur = [], []
    for i, m in zip(list(ids) + [None], list(mask) + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


def messages_of(r):
    return r.get("messages") if r.get("messages") is not None else r.get("conversations")


def encode_all(encoder, rows):
    good = []
    for r in rows:
        try:
            good.append((r, *encoder.encode_row(r)))
        except BadRow as bad:
            assert bad.reason in SKIP_REASONS
            try:
                msgs = normalize_messages(messages_of(r))
            except BadRow:
                continue
            if bad.reason == "unfinished_reply" and any(is_unfinished(m) for m in msgs):
                continue  # a reply with an open <think>: cut off, dropped under data.unfinished=drop
            # A well-formed conversation must always encode under a verbatim (ChatML) template.
            raise AssertionError(f"well-formed row skipped as {bad.reason}: {r!r}") from None
    return good


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(row, min_size=1, max_size=6))
def test_rows_never_crash_and_mask_only_assistant_replies(encoder, rows):
    tok = encoder.tokenizer
    good = encode_all(encoder, rows)
    for r, ids, mask in good:
        assert len(ids) == len(mask) and any(mask) and max(ids) < len(tok)
        messages = normalize_messages(messages_of(r))
        # ChatML renders replies verbatim: the supervised runs are exactly the replies + end token
        # (leading whitespace may share a token with the header's newline).
        want = [(m["content"] + END).lstrip()
                for m in messages if m["role"] == "assistant" and m["content"].strip()]
        assert [run.lstrip() for run in masked_runs(tok, ids, mask)] == want
    if good:
        lengths = [len(ids) for _, ids, _ in good]
        for row_idx in plan_batches(lengths, T, range(len(good)), num_open=3):
            b = pack_rows([good[i][1:] for i in row_idx], T, tok.pad_token_id)
            check_batch(b, seq_len=T, pad_id=tok.pad_token_id)
            for d, i in enumerate(row_idx):  # every document is its row, cut to T, never split
                n = min(lengths[i], T)
                assert b.input_ids[b.doc_ids == d].tolist() == good[i][1][:n]
                assert b.loss_mask[b.doc_ids == d].tolist() == good[i][2][:n]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(row, min_size=1, max_size=8),
       broken=st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")),
                       max_size=2))
# Keys that load into Arrow but that datasets cannot address (found by this test once; kept here).
@example(rows=[{"messages": []}, {"": {"": None, "\x00": None}}], broken=[])
@example(rows=[{"messages": []}, {"": {"\x00": {}}}], broken=[])
@example(rows=[{"messages": []}, {"": {}, "\x00": None}], broken=[])
def test_files_of_junk_stream_valid_batches(encoder, tmp_path_factory, rows, broken):
    tok = encoder.tokenizer
    path = tmp_path_factory.mktemp("junk") / "rows.jsonl"
    valid = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    path.write_bytes(b"\n".join([json.dumps(r).encode() for r in rows + valid] + broken) + b"\n")
    cfg = DataConfig(path=str(path), seq_len=T)
    ds, skipped = tokenize_dataset(load_conversations(cfg), tok, cfg)
    assert set(skipped) <= set(SKIP_REASONS)
    assert len(ds) + sum(skipped.values()) == len(rows) + 1 + sum(bool(b.strip()) for b in broken)
    stream = ShardStream(ds, 0, 1, T, tok.pad_token_id, num_open=2)
    docs = 0
    for _ in range(stream.batches_per_epoch()):
        b = next(stream)
        check_batch(b, seq_len=T, pad_id=tok.pad_token_id)
        docs += b.num_docs
    assert docs == len(ds) and stream.state_dict() == {"epoch": 1, "batch": 0}


# Replies with reasoning, for the Qwen3-like template (which drops or re-renders <think> blocks).
# Header text inside a reply is left out here: it may legitimately make a row unparseable (a skip).
plain = st.lists(st.one_of(st.sampled_from(["<|im_end|>", "<think>", "</think>", "\n", " ", "ok", "é"]),
                           st.text(max_size=4)), max_size=5).map("".join)
# The turn's end marker inside reasoning is ambiguous (the row may be skipped): kept out here.
reply = st.one_of(plain, st.tuples(plain, st.sampled_from(["", "\n", "\n\n"]), plain).map(
    lambda t: f"<think>{t[0]}</think>{t[1]}{t[2]}"
)).filter(lambda c: "<|im_end|>" not in c.split("</think>")[0])
think_chat = st.lists(st.tuples(plain, reply), min_size=1, max_size=4).map(turns_to_messages)


def think_reference(messages):
    """What the Qwen3-like template renders for each assistant reply, and whether it is supervised."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = []
    for i, m in enumerate(messages):
        c = m["content"]
        if m["role"] != "assistant":
            continue
        thought, body = "", c
        if "</think>" in c:
            thought = c.split("</think>")[0].split("<think>")[-1].strip("\n")
            body = c.split("</think>")[-1].lstrip("\n")
        rerender = i > last_user and (thought or i == len(messages) - 1)
        shown = f"<think>\n{thought}\n</think>\n\n{body}" if rerender else body
        if c.split("</think>")[-1].strip() or (c.strip() and shown.lstrip().startswith(c.strip())):
            out.append((shown + END).lstrip())
    return out


@pytest.fixture(scope="module")
def think_encoder():
    tok = build_demo_tokenizer(demo_texts())
    tok.chat_template = THINK_TEMPLATE
    return ChatEncoder(tok)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=think_chat)
def test_think_template_masks_exactly_the_rendered_replies(think_encoder, messages):
    try:
        ids, mask = think_encoder.encode_messages(messages)
    except BadRow as bad:
        if bad.reason == "unfinished_reply":  # a reply opening <think> and never closing it: cut off
            assert any(m["role"] == "assistant" and unclosed_think(m["content"]) for m in messages)
            return
        assert bad.reason in ("no_assistant", "no_supervised_tokens") and not think_reference(messages)
        return
    runs = [run.lstrip() for run in masked_runs(think_encoder.tokenizer, ids, mask)]
    assert runs == think_reference(messages)
