"""Training data rendered as the drafter will be served: the template's thinking switch end to end
(regenerate -> train -> evaluate), cut-off replies, and reasoning / tool-call / tool-result turns."""

import copy
import json
import logging

import pytest
import torch

from dflash_mp.data import ChatEncoder, DataConfig, build_stream, load_conversations, tokenize_dataset
from dflash_mp.builtin import build_demo_tokenizer, demo_texts

from test_data_property import masked_runs

END = "<|im_end|>"
HEADER = "<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"

# A Qwen3-style template written for these tests: `enable_thinking=false` puts an empty think block
# in the generation prompt; assistant turns after the last user message render their reasoning
# (`reasoning_content`, or a `<think>` block inlined in the content) as a think block (the last turn
# always gets one); tool calls follow the answer as <tool_call> JSON; consecutive tool results share
# one user turn; offered tools go into the system turn.
QWEN3_STYLE = (
    "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n<tools>' -}}{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set body = m.content or '' -%}{%- set thought = m.reasoning_content or '' -%}"
    "{%- if '</think>' in body -%}"
    "{%- set thought = body.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set body = body.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user and (loop.last or thought) -%}"
    "{{- '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- body -}}"
    "{%- for c in m.tool_calls or [] -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + (c.function.arguments | tojson)"
    " + '}\\n</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)
OFF, ON = {"enable_thinking": False}, {"enable_thinking": True}


@pytest.fixture(scope="module")
def tok():
    t = build_demo_tokenizer(demo_texts())
    t.chat_template = QWEN3_STYLE
    return t


def assistant_bodies(text: str, thinking_off: bool) -> list[str]:
    """Reference, read off the rendered text alone: everything between each assistant header and
    its end marker (end marker included), less the empty think block a thinking-off generation
    prompt would have supplied."""
    out = []
    for part in text.split(HEADER)[1:]:
        body = part[: part.index(END) + len(END)]
        if thinking_off and body.startswith(EMPTY_THINK):
            body = body[len(EMPTY_THINK):]
        out.append(body)
    return out


# ---------------------------------------------------------------------------------------------
# Reasoning, tool calls, tool results: the mask is exactly what the assistant wrote.

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_ROW = {
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "You are a helper."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting; greet back."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the tool, twice.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "0", "name": "get_weather", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "1", "name": "get_weather", "content": "{\"temp\": 25}"},
        {"role": "assistant", "content": "Paris 21 C, Rome 25 C.", "reasoning_content": "Both came back."},
    ],
}


@pytest.mark.parametrize("kwargs", [ON, OFF], ids=["thinking_on", "thinking_off"])
def test_reasoning_and_tool_turns_mask_exactly_the_assistant_spans(tok, kwargs):
    enc = ChatEncoder(tok, chat_template_kwargs=kwargs)
    ids, mask = enc.encode_row(TOOL_ROW)
    text = tok.apply_chat_template(TOOL_ROW["messages"], tools=TOOLS, tokenize=False, **kwargs)
    assert tok.decode(ids) == text
    bodies = assistant_bodies(text, thinking_off=kwargs == OFF)
    assert masked_runs(tok, ids, mask) == bodies
    supervised = "".join(bodies)
    # Reasoning and tool-call text are what the model writes: supervised, where the template shows
    # them (the greeting's reasoning sits before the last user message, so the template drops it).
    assert "I need the tool, twice." in supervised and "Both came back." in supervised
    assert "A greeting" not in text
    assert supervised.count("<tool_call>") == 2 and '"arguments": {"city": "Rome"}' in supervised
    # Tool results, the offered tools, system and user turns are inputs: never supervised.
    for unsupervised in ("<tool_response>", "temp", "get_weather\", \"description", "You are a helper.",
                         "Weather in Paris", "Hi there"):
        assert unsupervised in text and unsupervised not in supervised
    # Every supervised token lies inside an assistant turn and every assistant-turn token past the
    # header is supervised: the token count agrees with the reference.
    assert sum(mask) == sum(len(tok(b, add_special_tokens=False)["input_ids"]) for b in bodies)


def test_tool_call_turn_without_reasoning_and_bad_tool_calls(tok):
    row = copy.deepcopy(TOOL_ROW)
    for m in row["messages"]:
        m.pop("reasoning_content", None)
    ids, mask = ChatEncoder(tok).encode_row(row)
    runs = masked_runs(tok, ids, mask)
    assert runs[1].startswith("\n<tool_call>\n{\"name\": \"get_weather\"") and runs[1].endswith("</tool_call>" + END)
    from dflash_mp.data import BadRow

    row["messages"][4]["tool_calls"] = "get_weather(Paris)"
    with pytest.raises(BadRow, match="bad_tool_calls"):
        ChatEncoder(tok).encode_row(row)


# ---------------------------------------------------------------------------------------------
# A target whose greedy reply is known: a bigram chain wired into a tiny Qwen3.

REPLY = "Paris is nice."


def chain_target(out_dir, tok):
    """A tiny Qwen3 whose layers add nothing (o_proj, down_proj zero), so the logits depend on the
    last token alone; the head is wired so greedy decoding after any generation prompt writes
    REPLY and then <|im_end|>."""
    from transformers import AutoModelForCausalLM

    from dflash_mp.builtin import demo_qwen3_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(demo_qwen3_config(tok))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        reply = tok(REPLY, add_special_tokens=False)["input_ids"]
        assert len(set(reply)) == len(reply)
        starts = {tok(tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                              add_generation_prompt=True, **kw),
                      add_special_tokens=False)["input_ids"][-1] for kw in (ON, OFF)}
        assert not starts & set(reply)
        end = tok.convert_tokens_to_ids(END)
        chain = [(s, reply[0]) for s in starts] + list(zip(reply, reply[1:] + [end]))
        for x, y in chain:
            head[y] += 20 * emb[x] / emb[x].norm()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("serving")
    target = chain_target(d / "target", tok)
    rows = [
        {"messages": [{"role": "user", "content": "Where to go?"}, {"role": "assistant", "content": "old"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A city?"},
                      {"role": "assistant", "content": "old"}, {"role": "user", "content": "Another?"},
                      {"role": "assistant", "content": "old"}]},
    ] * 4
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d, target, src


def regenerate(d, target, src, name, kwargs, capsys, *extra):
    from dflash_mp.regenerate import main

    out = d / f"{name}.jsonl"
    flag = str(kwargs["enable_thinking"]).lower()
    main([f"target.path={target}", f"data.path={src}", f"out={out}", "batch_size=3",
          f"++data.chat_template_kwargs.enable_thinking={flag}", *extra])
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return out, stats, [json.loads(line) for line in open(out)]


def supervised_texts(tok, path, kwargs, **cfg):
    """Supervised text of every packed batch the training stream would send, per document."""
    cfg = DataConfig(path=str(path), seq_len=128, shuffle=False, chat_template_kwargs=kwargs, **cfg)
    stream = build_stream(cfg, tok, 0, 1)
    runs = []
    for _ in range(stream.batches_per_epoch(0)):
        b = next(stream)
        runs += masked_runs(tok, b.input_ids.tolist(), (b.loss_mask * (b.doc_ids >= 0)).tolist())
    return runs, stream.stats()


def test_thinking_switch_regenerate_train_evaluate(setup, tok, capsys, caplog, tmp_path):
    d, target, src = setup
    runs = {}
    for name, kwargs in (("off", OFF), ("on", ON)):
        out, stats, rows = regenerate(d, target, src, name, kwargs, capsys, "max_new_tokens=16")
        assert stats["written"] == 8 and not stats.get("unfinished")
        replies = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
        assert all(m["content"] == REPLY and m["finished"] is True for m in replies)
        runs[name], counters = supervised_texts(tok, out, kwargs)
        assert not any(k.startswith("skipped/") for k in counters)
        assert len(runs[name]) == 12  # 4 one-turn + 4 two-turn conversations
    # Thinking off: the empty block is the prompt's, never supervised; only the reply and its end.
    assert set(runs["off"]) == {REPLY + END}
    assert not any("<think>" in r or "</think>" in r for r in runs["off"])
    # Thinking on: the model writes the block itself, so it is supervised (on the turns the
    # template renders it: after the last user message).
    assert sorted(set(runs["on"])) == sorted({REPLY + END, EMPTY_THINK + REPLY + END})
    assert sum(r.startswith("<think>") for r in runs["on"]) == 8

    # Evaluate renders its prompts the same way, and warns when the export was trained otherwise.
    from dflash_mp.config import compose
    from dflash_mp.evaluate import main as evaluate_main
    from dflash_mp.export import export_drafter
    from dflash_mp.runtime import prepare
    from dflash_mp.model import DFlashDrafter
    from dflash_mp.trainer import build_drafter_args

    job = compose([f"target.path={target}"])
    res = prepare(job)
    tcfg, layer_ids, mask = res.target_config, res.layer_ids, res.mask_token_id
    args = build_drafter_args(job.drafter, tcfg, layer_ids, mask)
    export = export_drafter(DFlashDrafter(args), args, tmp_path / "export", tcfg, chat_template_kwargs=OFF)
    common = [f"checkpoint={export}", f"target.path={target}", f"data.path={d / 'off.jsonl'}", "data.seq_len=128",
              "eval.num_prompts=2", "eval.max_new_tokens=16", "eval.num_batches=1", "eval.num_anchors=16"]
    with caplog.at_level(logging.WARNING, logger="dflash_mp.evaluate"):
        evaluate_main([*common, "++data.chat_template_kwargs.enable_thinking=false"])
        assert not [r for r in caplog.records if "chat_template_kwargs" in r.getMessage()]
        report = json.load(open(export / "eval.json"))
        assert report["chat_template_kwargs"] == OFF == report["export_chat_template_kwargs"]
        # Live decoding starts from the thinking-off prompt and writes what regenerate wrote.
        assert report["live"]["lossless"] and report["live"]["prompts"][0]["generated"] == len(
            tok(REPLY + END, add_special_tokens=False)["input_ids"])
        evaluate_main([*common, "++data.chat_template_kwargs.enable_thinking=true"])
    warned = [r.getMessage() for r in caplog.records if "chat_template_kwargs" in r.getMessage()]
    assert len(warned) == 1 and "'enable_thinking': False" in warned[0] and "'enable_thinking': True" in warned[0]


def test_cut_replies_are_dropped_or_kept_open_never_closed(setup, tok, capsys):
    d, target, src = setup
    out, stats, rows = regenerate(d, target, src, "cut", OFF, capsys, "max_new_tokens=3")
    assert stats["unfinished"] == 12 and stats["written"] == 8
    replies = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    cut = tok.decode(tok(REPLY, add_special_tokens=False)["input_ids"][:3])
    assert all(m["finished"] is False and m["content"] == cut.strip() for m in replies)

    cfg = DataConfig(path=str(out), chat_template_kwargs=OFF, unfinished="drop")
    kept, skipped = tokenize_dataset(load_conversations(cfg), tok, cfg)
    assert len(kept) == 0 and skipped == {"unfinished_reply": 8}
    runs, counters = supervised_texts(tok, out, OFF, unfinished="keep_open")
    assert not any(k.startswith("skipped/") for k in counters)
    # The reply is supervised as far as the model wrote it: no end-of-turn token, no think block.
    assert runs == [cut.strip()] * 12
    assert not any(END in r for r in runs)


def test_unclosed_think_block_is_unfinished(tok):
    from dflash_mp.data import BadRow, tokenize_conversation
    from dflash_mp.regenerate import reply_message

    msg = reply_message("<think>\nstill weighing Paris against", finished=True)
    assert msg == {"role": "assistant", "content": "", "reasoning_content": "still weighing Paris against",
                   "finished": False}
    msgs = [{"role": "user", "content": "A city?"}, msg]
    with pytest.raises(BadRow, match="unfinished_reply"):
        tokenize_conversation(tok, msgs, chat_template_kwargs=ON)
    ids, mask = tokenize_conversation(tok, msgs, chat_template_kwargs=ON, unfinished="keep_open")
    # The template closes the block and the turn; neither was written by the model.
    assert tok.decode(ids).endswith("still weighing Paris against\n</think>\n\n" + END + "\n")
    assert masked_runs(tok, ids, mask) == ["<think>\nstill weighing Paris against"]
    # Inlined in the content (no reasoning_content), the same reply is recognised as cut as well.
    inline = [msgs[0], {"role": "assistant", "content": "<think>\nstill weighing"}]
    with pytest.raises(BadRow, match="unfinished_reply"):
        tokenize_conversation(tok, inline, chat_template_kwargs=ON)
    ids, mask = tokenize_conversation(tok, inline, chat_template_kwargs=ON, unfinished="keep_open")
    assert masked_runs(tok, ids, mask) == ["<think>\nstill weighing"]


def test_tool_calls_from_a_file_keep_each_rows_own_arguments(tok, tmp_path):
    """Rows whose tool schemas and calls differ load as written: one merged Arrow struct for all rows
    would give the first row the second row's `units` key, as nulls the template renders (datasets
    stores such objects as Json values)."""
    rows = [copy.deepcopy(TOOL_ROW) for _ in range(2)]
    rows[1]["messages"][4]["tool_calls"][0]["function"]["arguments"] = {"city": "Rome", "units": "metric"}
    rows[1]["tools"][0]["function"]["parameters"]["properties"]["units"] = {"type": "string"}
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(path))
    ds, skipped = tokenize_dataset(load_conversations(cfg), tok, cfg)
    assert not skipped
    enc = ChatEncoder(tok)
    assert [ds[i]["input_ids"] for i in range(2)] == [enc.encode_row(r)[0] for r in rows]
    assert "units" not in tok.decode(ds[0]["input_ids"]) and "null" not in tok.decode(ds[0]["input_ids"])
