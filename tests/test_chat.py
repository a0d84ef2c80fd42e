"""Chat tokenisation: the loss mask covers exactly the assistant replies, bad rows are counted."""

import copy
import json

import pytest

from dflash_mp.data import (
    BadRow,
    ChatEncoder,
    DataConfig,
    load_conversations,
    tokenize_conversation,
    tokenize_dataset,
)
from dflash_mp.builtin import build_demo_tokenizer, demo_data_path, demo_texts

END = "<|im_end|>"

# A Qwen3-like template (written for this test): assistant turns before the last user message lose
# their <think> block, later ones get it re-rendered in a canonical layout (the final one always gets
# a block, empty if there was no reasoning).
THINK_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set body = m.content -%}{%- set thought = '' -%}"
    "{%- if '</think>' in body -%}"
    "{%- set thought = body.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set body = body.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and (thought or loop.last) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + body + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + body + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# No assistant header at all (Mistral-like), and a reply the template trims.
HEADERLESS_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '[INST] ' + m.content + ' [/INST]' -}}"
    "{%- elif m.role == 'assistant' -%}{{- m.content | trim -}}{{- '<|endoftext|>' -}}{%- endif -%}"
    "{%- endfor -%}"
)


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer(demo_texts())


def with_template(tok, template):
    other = copy.deepcopy(tok)
    other.chat_template = template
    return other


def masked_runs(tok, ids, mask):
    """Decoded text of every maximal run of supervised tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def conv(*pairs, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for user, assistant in pairs:
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return msgs


def test_single_turn_mask_is_reply_plus_end_token(tok):
    msgs = conv(("What is 2 + 2?", "2 + 2 = 4."))
    ids, mask = tokenize_conversation(tok, msgs)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert masked_runs(tok, ids, mask) == ["2 + 2 = 4." + END]
    # Everything unsupervised decodes to the prompt, the role header and the trailing newline.
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert unmasked == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n\n"


def test_multi_turn_with_system_prompt(tok):
    msgs = conv(("Spell 'cat' backwards.", "tac"), ("Sort: 3, 1, 2", "1, 2, 3."), ("Hi", "Hello!"),
                system="You are a helpful assistant.")
    ids, mask = tokenize_conversation(tok, msgs)
    assert masked_runs(tok, ids, mask) == ["tac" + END, "1, 2, 3." + END, "Hello!" + END]
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_reply_repeating_the_prompt_is_masked_in_its_own_turn(tok):
    msgs = conv(("hello", "hello"), ("hello hello", "hello"))
    ids, mask = tokenize_conversation(tok, msgs)
    assert masked_runs(tok, ids, mask) == ["hello" + END, "hello" + END]
    text = tok.decode(ids)
    first = mask.index(1)
    assert tok.decode(ids[:first]).endswith("<|im_start|>assistant\n") and text.count("hello") == 5


def test_sharegpt_rows_match_role_content_rows(tok, tmp_path):
    msgs = conv(("Convert 2 hours to minutes.", "2 x 60 = 120 minutes."), system="Answer briefly.")
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    share = [{"from": names[m["role"]], "value": m["content"]} for m in msgs]
    enc = ChatEncoder(tok)
    assert enc.encode_row({"conversations": share}) == enc.encode_row({"messages": msgs})
    path = tmp_path / "share.jsonl"
    path.write_text("\n".join(json.dumps({"conversations": share}) for _ in range(3)))
    cfg = DataConfig(path=str(path), messages_field="conversations")
    ds, skipped = tokenize_dataset(load_conversations(cfg), tok, cfg)
    assert not skipped and len(ds) == 3 and ds[0]["input_ids"] == enc.encode_row({"messages": msgs})[0]


def test_think_stripping_template(tok):
    qtok = with_template(tok, THINK_TEMPLATE)
    msgs = conv(("first?", "<think>plan A</think>Answer A"), ("second?", "<think>plan B</think>\nAnswer B"))
    full = qtok.apply_chat_template(msgs, tokenize=False)
    prefix = qtok.apply_chat_template(msgs[:2], tokenize=False)
    assert not full.startswith(prefix), "the template must rewrite earlier turns for this test to matter"
    assert "plan A" not in full and "<think>\nplan B\n</think>\n\nAnswer B" in full
    ids, mask = tokenize_conversation(qtok, msgs)
    assert masked_runs(qtok, ids, mask) == ["Answer A" + END, "<think>\nplan B\n</think>\n\nAnswer B" + END]


def test_think_block_repeating_the_answer(tok):
    # The answer also occurs inside the re-rendered reasoning: the span must still end at the reply.
    qtok = with_template(tok, THINK_TEMPLATE)
    msgs = conv(("q", "<think>42</think>42"))
    ids, mask = tokenize_conversation(qtok, msgs)
    assert masked_runs(qtok, ids, mask) == ["<think>\n42\n</think>\n\n42" + END]
    # Same reply twice: the stripped first turn must not be matched in the second one.
    msgs = conv(("q", "<think>\nx\n</think>\n\nY"), ("q2", "<think>\nx\n</think>\n\nY"))
    ids, mask = tokenize_conversation(qtok, msgs)
    assert masked_runs(qtok, ids, mask) == ["Y" + END, "<think>\nx\n</think>\n\nY" + END]


def test_generation_prompt_that_opens_a_think_block(tok):
    # Qwen3 with thinking off / DeepSeek-R1 put "<think>..." in the generation prompt but not in past
    # turns: the header proper stops before it.
    otok = with_template(tok, THINK_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
        "{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"))
    prompt = otok.apply_chat_template([{"role": "user", "content": "one"}], tokenize=False,
                                      add_generation_prompt=True)
    assert prompt.endswith("assistant\n<think>\n")
    ids, mask = tokenize_conversation(otok, conv(("one", "first"), ("two", "<think>hm</think>second")))
    assert masked_runs(otok, ids, mask) == ["first" + END, "<think>\nhm\n</think>\n\nsecond" + END]


def test_headerless_template_and_trimmed_reply(tok):
    htok = with_template(tok, HEADERLESS_TEMPLATE)
    msgs = conv(("one", "  first reply  "), ("two", "second"))
    ids, mask = tokenize_conversation(htok, msgs)
    assert masked_runs(htok, ids, mask) == ["first reply<|endoftext|>", "second<|endoftext|>"]


GOOD = conv(("What is 1 + 1?", "1 + 1 = 2."))
BAD_ROWS = [  # (row, reason)
    ({"messages": "hello"}, "not_a_list"),
    ({"messages": []}, "empty"),
    ({"messages": [GOOD[0], "oops"]}, "message_not_dict"),
    ({"messages": [{"content": "hi"}, GOOD[1]]}, "missing_role"),
    ({"messages": [{"role": "narrator", "content": "hi"}, GOOD[1]]}, "unknown_role"),
    ({"messages": [{"role": ["user"], "content": "hi"}, GOOD[1]]}, "unknown_role"),
    ({"messages": [GOOD[0], {"role": "assistant", "content": 5}]}, "content_not_string"),
    ({"messages": [GOOD[0], {"role": "assistant", "content": ["a", "b"]}]}, "content_not_string"),
    ({"messages": [GOOD[0], {"role": "assistant", "content": "bad \ud800 surrogate"}]}, "invalid_unicode"),
    ({"messages": [GOOD[0]]}, "no_assistant"),
    ({"messages": [GOOD[0], {"role": "assistant", "content": "  \n "}]}, "no_assistant"),
    ({"text": "no conversation here"}, "missing_field"),
]


@pytest.mark.parametrize("row,reason", BAD_ROWS)
def test_bad_row_reasons(tok, row, reason):
    with pytest.raises(BadRow) as err:
        ChatEncoder(tok).encode_row(row)
    assert err.value.reason == reason


def test_bad_rows_from_templates_and_vocab(tok):
    upper = with_template(tok, "{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    raising = with_template(tok, "{% for m in messages %}{% if m.role == 'system' %}"
                                 "{{ raise_exception('no system role') }}{% endif %}"
                                 "{{ m.content }}{% endfor %}")
    qtok = with_template(tok, THINK_TEMPLATE)
    cases = [
        (upper, conv(("hi", "a lower-case reply")), None, "assistant_not_rendered"),
        (raising, conv(("a", "b"), system="s"), None, "template_error"),
        (qtok, conv(("a", "<think>only thoughts</think>"), ("b", "<think>more</think>\n")), None,
         "no_supervised_tokens"),
        (tok, GOOD, 10, "token_out_of_vocab"),
    ]
    for t, msgs, limit, reason in cases:
        with pytest.raises(BadRow) as err:
            tokenize_conversation(t, msgs, vocab_limit=limit)
        assert err.value.reason == reason


def test_bad_rows_in_a_file_are_counted_not_fatal(tok, tmp_path):
    """Rows that do not share one Arrow schema (and broken lines) go through the tolerant reader."""
    lines = [json.dumps({"messages": GOOD}).encode()] * 3
    lines += [json.dumps(row).encode() for row, _ in BAD_ROWS]
    lines += [b"{not json", b"\xff\xfe{}", b"[1, 2]"]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = DataConfig(path=str(path))
    ds, skipped = tokenize_dataset(load_conversations(cfg), tok, cfg)
    expected = {}
    for _, reason in BAD_ROWS:
        expected[reason] = expected.get(reason, 0) + 1
    expected.update(invalid_json=1, invalid_utf8=1, row_not_object=1)
    assert dict(skipped) == expected
    assert len(ds) == 3 and ds.column_names == ["input_ids", "loss_mask"]
    assert list(ds[0]["input_ids"]) == tokenize_conversation(tok, GOOD)[0]


def test_tokenize_dataset_parallel_matches_serial(tok, tmp_path):
    import datasets

    rows = [{"messages": conv((f"q{i}", f"a{i} " * (i % 5 + 1)))} for i in range(40)] + [{"messages": []}]
    ds = datasets.Dataset.from_list(rows)
    one, skipped1 = tokenize_dataset(ds, tok, DataConfig(num_proc=1))
    two, skipped2 = tokenize_dataset(ds, tok, DataConfig(num_proc=2))
    assert skipped1 == skipped2 == {"empty": 1}
    assert one["input_ids"] == two["input_ids"] and one["loss_mask"] == two["loss_mask"]


def test_local_sources_and_max_rows(tok, tmp_path):
    import datasets

    data = tmp_path / "parts"
    data.mkdir()
    for k in range(2):
        datasets.Dataset.from_list([{"messages": GOOD}] * 5).to_parquet(str(data / f"part{k}.parquet"))
    assert len(load_conversations(DataConfig(path=str(data)))) == 10
    assert len(load_conversations(DataConfig(path=str(data), max_rows=4))) == 4
    assert len(load_conversations(DataConfig(path=str(data), split="train[:30%]"))) == 3
    assert len(load_conversations(DataConfig(path=demo_data_path()))) == 800  # builtin:demo


@pytest.mark.parametrize("make,match", [
    (lambda p: DataConfig(path=str(p / "missing.jsonl")), "does not exist"),
    (lambda p: DataConfig(path=str(p / "notes.txt")), "unknown extension"),
    (lambda p: DataConfig(path=str(p / "emptydir")), "no .json"),
    (lambda p: DataConfig(path=str(p / "notes.txt").replace("notes.txt", "x.jsonl"), split="test"), "train"),
])
def test_bad_sources_raise_with_the_fix(tmp_path, make, match):
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "x.jsonl").write_text(json.dumps({"messages": GOOD}))
    with pytest.raises(ValueError, match=match):
        load_conversations(make(tmp_path))


def test_config_validation():
    with pytest.raises(ValueError, match="seq_len=8"):
        DataConfig(seq_len=8)
    with pytest.raises(ValueError, match="eval_fraction"):
        DataConfig(eval_fraction=1.0)
    with pytest.raises(ValueError, match="num_proc"):
        DataConfig(num_proc=0)


def test_tokenizer_without_template_is_a_config_error(tok):
    bare = with_template(tok, None)
    with pytest.raises(ValueError, match="chat template"):
        ChatEncoder(bare)
