"""Evaluate an exported drafter against its target: simulated and live acceptance.

    python -m dflash_mp.evaluate eval.checkpoint=outputs/default/export [target.path=...] [data.path=...] \
        [eval.num_prompts=16] [eval.max_new_tokens=64] [eval.block_size=B] [eval.out=PATH]

`target.*` and `data.*` are the training job's config fields (same defaults, same overrides), so the
evaluation sees the target and data the drafter was trained with. Two measurements:

- **sim**: the target runs over packed held-out batches (`data.eval_fraction > 0`; otherwise the
  first rows of the data) and the drafter predicts a block at every anchor candidate. `tau_sim` is the
  mean, over the blocks greedy speculative decoding lays along each reply (`walk_decode_path`), of 1 +
  the leading correct slots; when the data is the target's own greedy output (`dflash_mp.regenerate`)
  it predicts live `tau`. `tau_sim_anchors` is the same mean over every anchor, the quantity training
  logs as `drafter/tau_sim`; it overstates live `tau` when acceptance varies along a reply, since
  decoding crosses easy stretches in few blocks and spends most blocks where acceptance is low.
  Per-slot accuracy is over every anchor, as in training.
- **live**: greedy speculative decoding (`dflash_mp.speculative`) on prompts taken from the same
  conversations (every assistant turn's prefix, rendered with the chat template and a generation
  prompt): mean acceptance length `tau`, its histogram, target forwards per generated token, and the
  wall-clock speedup over plain greedy decoding (meaningful on a GPU; on CPU it is reported and
  labelled as such). Every prompt's output must equal plain greedy decoding; if one does not, the
  report is still written and the command fails.

Prompts and held-out rows are rendered with `data.chat_template_kwargs`; when the export records
other options (it was trained on text rendered differently, e.g. with thinking on), a warning says so
and the report keeps both (`chat_template_kwargs`, `export_chat_template_kwargs`).

The report is printed and written as JSON to `eval.out` (default `<checkpoint>/eval.json`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections import Counter
from dataclasses import dataclass

import torch

from .cli import entry, tool_main

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    checkpoint: str = ""  # export directory (config.json + model.safetensors)
    out: str = ""  # report path; "" = <checkpoint>/eval.json
    num_prompts: int = 16  # live decoding prompts
    max_new_tokens: int = 64  # per live prompt
    block_size: int = 0  # block size for both measurements; 0 = the drafter's own
    num_batches: int = 8  # held-out packed batches for tau_sim; 0 = all
    num_anchors: int = 128  # blocks per drafter call for tau_sim (every anchor candidate is evaluated)


def _good_conversations(job, tokenizer, vocab_limit: int) -> list[tuple[list[dict], list | None]]:
    """The rows the trainer keeps (same checks), held-out ones only when `data.eval_fraction > 0`."""
    import datasets

    from .data import split_eval
    from .data.chat import BadRow, ChatEncoder, load_conversations
    from .data.chat import row_messages, row_tools

    encoder = ChatEncoder(tokenizer, vocab_limit, job.data.messages_field, job.data.chat_template_kwargs,
                          job.data.unfinished)
    good = []
    for row in load_conversations(job.data):
        try:
            messages, tools = row_messages(row, job.data.messages_field), row_tools(row)
            encoder.encode_messages(messages, tools=tools)
        except BadRow:
            continue
        good.append((messages, tools))
    if job.data.eval_fraction > 0:
        index = datasets.Dataset.from_dict({"i": list(range(len(good)))})
        _, held = split_eval(index, job.data.eval_fraction, job.data.seed)
        good = [good[i] for i in held["i"]]
    return good


def eval_prompts(conversations: list, tokenizer, num_prompts: int,
                 chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """The prefix before every assistant turn, rendered with a generation prompt, in data order.
    `conversations`: message lists, or (messages, tools) pairs."""
    from .data.chat import render_chat

    prompts = []
    for conv in conversations:
        messages, tools = conv if isinstance(conv, tuple) else (conv, None)
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and len(prompts) < num_prompts:
                text = render_chat(tokenizer, messages[:i], chat_template_kwargs, True, tools)
                prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def walk_decode_path(accept: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor,
                     candidates: torch.Tensor) -> list[int]:
    """Acceptance lengths along the path live decoding takes through the data.

    `accept[a]` is the acceptance length of the block anchored at `a`. Decoding an assistant turn
    starts with its first token as the anchor and moves to `a + accept[a]` after each verify step,
    until the anchor is no longer a candidate (the end of the turn). When the data is the target's
    own greedy output, this is exactly what live decoding would accept.
    """
    lm = loss_mask.bool() & (doc_ids >= 0)
    prev = torch.cat([lm.new_zeros(1), lm[:-1]])
    same_doc = torch.cat([doc_ids.new_full((1,), -2), doc_ids[:-1]]) == doc_ids
    starts = (lm & ~(prev & same_doc)).nonzero().flatten().tolist()
    # One copy to the host; the walk then reads Python lists (no device sync per step on a GPU).
    acc, cand, docs = accept.tolist(), candidates.tolist(), doc_ids.tolist()
    steps = []
    for a in starts:
        doc = docs[a]
        while a < len(cand) and cand[a] and docs[a] == doc:
            steps.append(acc[a])
            a += acc[a]
    return steps


@torch.no_grad()
def simulate(job, target_path: str, tokenizer, target_config: dict, drafter, args, device, dtype,
             cfg: EvalConfig) -> dict:
    """Drafter acceptance on held-out packed batches, with every anchor candidate evaluated.

    `tau_sim` (over `blocks`): the mean of 1 + the leading correct slots over the blocks decoding lays
    down (`walk_decode_path`); what live decoding accepts when the data is the target's greedy output.
    `tau_sim_anchors` (over `anchors`), `acc_slot` and `loss`: over every anchor, as training logs them
    (`drafter/tau_sim`). Every position weighs the same there, while decoding crosses easy stretches in
    few blocks and spends most blocks where acceptance is low, so `tau_sim_anchors` overstates live
    `tau` whenever acceptance varies along a reply.
    """

    from .data import build_stream
    from .model import anchor_candidates, block_labels, build_blocks, dflash_loss, slot_weights
    from .model.loss import DEFAULT_GAMMA
    from .target import TargetWorker, load_target_head
    from .trainer import IntervalStats

    part = "eval" if job.data.eval_fraction > 0 else "train"
    data_cfg = dataclasses.replace(job.data, shuffle=False)
    stream = build_stream(data_cfg, tokenizer, 0, 1, vocab_limit=target_config["vocab_size"], part=part)
    num_batches = stream.batches_per_epoch(0)
    if cfg.num_batches:
        num_batches = min(num_batches, cfg.num_batches)
    worker = TargetWorker.load(target_path, args.target_layer_ids, device, dtype, job.target.attn_implementation,
                               packing_check=job.target.packing_check)
    embed, head = load_target_head(target_path, dtype, device)
    b, chunk = args.block_size, cfg.num_anchors
    weights = slot_weights(b, job.drafter.gamma or DEFAULT_GAMMA.get(b, 4.0), device=device)  # loss only
    stats = IntervalStats(b, device)
    path_blocks: list[int] = []
    backend = drafter.attention_backend(job.drafter.attention, device)  # once: a fallback is logged once
    it = iter(stream)
    for _ in range(num_batches):
        hb = worker.forward(next(it)).to(device, copy=True)
        cand = anchor_candidates(hb.loss_mask, hb.doc_ids)
        accept = torch.zeros_like(hb.input_ids)
        for group in cand.nonzero().flatten().split(chunk):
            n = group.shape[0]
            anchors = torch.cat([group, group.new_zeros(chunk - n)])
            valid = torch.arange(chunk, device=device) < n
            labels, label_mask = block_labels(hb.input_ids, hb.loss_mask, hb.doc_ids, anchors, valid, b)
            _, block_pos = build_blocks(hb.input_ids, hb.position_ids, anchors, b, args.mask_token_id)
            attn = drafter.build_attention(anchors, valid, hb.doc_ids, backend=backend)
            out = drafter.predict_blocks(hb.hidden, embed, hb.input_ids, anchors, hb.position_ids, block_pos, attn)
            loss, correct = dflash_loss(out, head, labels, label_mask, weights, job.drafter.loss_chunk_size)
            stats.add(loss, correct, label_mask, torch.zeros(()))
            stats.count(hb.num_valid_tokens)
            lead = (correct & label_mask)[:, 1:].long().cumprod(dim=1).sum(dim=1)
            accept[group] = 1 + lead[:n]
        path_blocks += walk_decode_path(accept, hb.loss_mask, hb.doc_ids, cand)
    s = {k: (v.item() if torch.is_tensor(v) else v) for k, v in stats.pop().items()}
    return {
        "held_out": part == "eval",
        "batches": num_batches,
        "loss": s["loss_sum"] / max(s["steps"], 1),
        "tau_sim": sum(path_blocks) / max(len(path_blocks), 1),
        "blocks": len(path_blocks),
        "tau_sim_anchors": s["tau_sum"] / max(s["blocks"], 1),
        "anchors": int(s["blocks"]),
        "acc_slot": {k: s[f"slot_correct_{k}"] / max(s[f"slot_count_{k}"], 1) for k in range(1, b)},
    }


def live(target, drafter, prompts: list[list[int]], stop_ids: list[int], cfg: EvalConfig,
         block_size: int) -> tuple[dict, list[str]]:
    """Speculative vs plain greedy decoding on every prompt; returns (report, lossless failures)."""
    from .speculative import check_lossless, greedy_generate, speculative_generate

    if not prompts:
        raise ValueError("no prompts: the evaluated conversations hold no assistant turn; check data.path")
    # Warm-up (allocator, first-call overheads) so the first prompt's timing is not an outlier.
    greedy_generate(target, prompts[0], 2, stop_ids)
    speculative_generate(target, drafter, prompts[0], 2, stop_ids, block_size)
    hist: Counter = Counter()
    failures, per_prompt = [], []
    tokens = spec_fwd = greedy_fwd = rollback_fwd = 0
    spec_s = greedy_s = 0.0
    for i, prompt in enumerate(prompts):
        g = greedy_generate(target, prompt, cfg.max_new_tokens, stop_ids)
        s = speculative_generate(target, drafter, prompt, cfg.max_new_tokens, stop_ids, block_size)
        try:
            check_lossless(i, s, g)
        except RuntimeError as err:
            failures.append(str(err))
        hist.update(s.acceptance_lengths)
        per_prompt.append({"prompt_tokens": len(prompt), "generated": len(s.tokens), "tau": s.tau,
                           "target_forwards": s.num_target_forwards})
        tokens += len(s.tokens)
        spec_fwd += s.num_target_forwards
        rollback_fwd += s.num_rollback_forwards
        greedy_fwd += g.num_target_forwards
        spec_s += s.seconds
        greedy_s += g.seconds
    steps = sum(hist.values())
    device = drafter.embed.device
    report = {
        "num_prompts": len(prompts),
        "block_size": block_size,
        "tau": sum(k * n for k, n in hist.items()) / max(steps, 1),
        "acceptance_histogram": {str(k): hist.get(k, 0) for k in range(1, block_size + 1)},
        "generated_tokens": tokens,
        "target_forwards": spec_fwd,
        # hybrid targets: extra forwards that re-advance recurrent state past a rejected proposal
        "rollback_forwards": rollback_fwd,
        "greedy_forwards": greedy_fwd,
        "target_forwards_per_token": spec_fwd / max(tokens, 1),
        "speculative_s": spec_s,
        "greedy_s": greedy_s,
        "speedup": greedy_s / spec_s if spec_s > 0 else 0.0,
        "speedup_device": device.type,
        "speedup_note": "" if device.type == "cuda" else
        f"measured on {device.type}: tiny models are overhead-bound here; only GPU speedups are meaningful",
        "lossless": not failures,
        "prompts": per_prompt,
    }
    return report, failures


def evaluate(job, cfg: EvalConfig) -> dict:
    from transformers import AutoTokenizer

    from . import process_options
    from .export import check_export_dir, exported_chat_template_kwargs, load_exported
    from .regenerate import stop_token_ids
    from .speculative import Drafter
    from .runtime import pick_device, resolve
    from .target import load_causal_lm, load_target_config, resolve_dtype

    if not cfg.checkpoint:
        raise ValueError("checkpoint= is missing; pass an export directory, e.g. checkpoint=outputs/default/export")
    check_export_dir(cfg.checkpoint)
    device = pick_device()  # under torchrun, one GPU per process
    dtype = resolve_dtype(job.target.dtype, device)
    job = resolve(job)
    # One process runs both models: the target's settings, as its forwards are most of the work.
    process_options.apply(job.target, device, "target")
    target_path = job.target.path
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target_config = load_target_config(target_path)
    drafter, args = load_exported(cfg.checkpoint, dtype=dtype, device=device)
    if cfg.block_size:
        args = dataclasses.replace(args, block_size=cfg.block_size)
        drafter.args = args
    drafter.eval()
    if args.hidden_size != target_config["hidden_size"] or args.vocab_size != target_config["vocab_size"]:
        raise ValueError(f"the drafter at {cfg.checkpoint} (hidden {args.hidden_size}, vocab {args.vocab_size}) does "
                         f"not fit the target at {target_path}; pass the target it was trained for (target.path=...)")

    ours, theirs = dict(job.data.chat_template_kwargs), exported_chat_template_kwargs(cfg.checkpoint)
    if theirs is not None and theirs != ours:
        log.warning("the drafter at %s was trained on text rendered with chat_template_kwargs=%s, this "
                    "evaluation renders with data.chat_template_kwargs=%s: acceptance will not show how it "
                    "serves; pass data.chat_template_kwargs=... as it was trained (or serve it that way)",
                    cfg.checkpoint, theirs, ours)
    sim = simulate(job, target_path, tokenizer, target_config, drafter, args, device, dtype, cfg)
    target = load_causal_lm(target_path, device, dtype)  # the job's target, builtins included
    conversations = _good_conversations(job, tokenizer, target_config["vocab_size"])
    prompts = eval_prompts(conversations, tokenizer, cfg.num_prompts, ours)
    live_report, failures = live(target, Drafter.for_target(drafter, args, target), prompts,
                                 stop_token_ids(tokenizer, target), cfg, args.block_size)
    report = {"checkpoint": os.path.abspath(cfg.checkpoint), "target": target_path, "data": job.data.path,
              "chat_template_kwargs": ours, "export_chat_template_kwargs": theirs,
              "sim": sim, "live": live_report, "failures": failures}
    out = cfg.out or os.path.join(cfg.checkpoint, "eval.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(format_report(report))
    print(f"report written to {out}")
    if failures:
        raise RuntimeError(f"{len(failures)} prompt(s) not lossless; first: {failures[0]}")
    return report


def format_report(report: dict) -> str:
    sim, lv = report["sim"], report["live"]
    b = lv["block_size"]
    lines = [
        f"{'drafter':<28}{report['checkpoint']}",
        f"{'tau_sim':<28}{sim['tau_sim']:.3f}   ({sim['blocks']} blocks laid as greedy decoding lays them, "
        f"{sim['batches']} {'held-out' if sim['held_out'] else 'first-rows'} batches)",
        f"{'tau_sim_anchors':<28}{sim['tau_sim_anchors']:.3f}   ({sim['anchors']} anchors, loss {sim['loss']:.3f}; "
        "training's drafter/tau_sim: overstates live tau, easy stretches weigh as much as hard ones)",
        f"{'acc per slot (anchors)':<28}" + " ".join(f"{sim['acc_slot'][k]:.2f}" for k in range(1, b)),
        f"{'live tau':<28}{lv['tau']:.3f}   ({lv['num_prompts']} prompts, {lv['generated_tokens']} tokens, "
        f"block {b})",
        f"{'acceptance histogram':<28}" + " ".join(f"{k}:{n}" for k, n in lv["acceptance_histogram"].items()),
        f"{'target forwards / token':<28}{lv['target_forwards_per_token']:.3f}   (greedy: "
        f"{lv['greedy_forwards'] / max(lv['generated_tokens'], 1):.3f})",
        f"{'speedup vs greedy':<28}{lv['speedup']:.2f}x   ({lv['speedup_device']}"
        f"{'; ' + lv['speedup_note'] if lv['speedup_note'] else ''})",
        f"{'lossless':<28}{'yes' if lv['lossless'] else 'NO'}",
    ]
    return "\n".join(lines)


def evaluate_command(job, cfg: EvalConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(levelname)s %(name)s] %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        evaluate(job, cfg)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    tool_main("eval", EvalConfig, evaluate_command, __doc__, argv)


if __name__ == "__main__":
    entry(main)
