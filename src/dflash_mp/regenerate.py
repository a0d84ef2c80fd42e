"""Rewrite a chat data set's assistant turns with the target's own responses.

A drafter learns to predict the target, so it should train on what the target itself says, not on
what some other model wrote (the DFlash recipe trains on target-regenerated data):

    python -m dflash_mp.regenerate target.path=Qwen/Qwen3-8B data.path=in.jsonl regen.out=out.jsonl \
        [regen.temperature=0] [regen.max_new_tokens=1024] [regen.batch_size=128] [regen.seed=0] [regen.cache=auto]

`target.*` and `data.*` are the training job's own config fields (`data.max_rows`, `data.split`,
`target.dtype`, ...). Each assistant turn is generated from the conversation so far (with the turns
regenerated before it), rendered with the chat template and a generation prompt; conversations are
generated in batches with left padding. Batches are formed by length: each window of
`batch_size * sort_window` conversations is sorted (by assistant turns, then rendered length,
longest first) before it is cut into batches, so a batch pads little and rarely waits on one long
reply; the window's rows are written in input order once all of it is done. `temperature=0` is
greedy (the output does not depend on batching); otherwise sampling is seeded per batch, so an
interrupted run resumed later writes the same rows as an uninterrupted one.

KV cache (`cache`, logged): `dynamic` is transformers' default cache, grown token by token, run
eagerly. `static` preallocates the cache, and on CUDA transformers then compiles the decode step
(`torch.compile`, its default mode `reduce-overhead`: CUDA graphs): the serving-speed path. Shapes stay
fixed so the compiled step is reused: every batch has `batch_size` rows (filler rows, copies of a real
prompt, make up a short batch and are dropped: never written, never counted) and its prompts are
left-padded to a multiple of `prompt_bucket` tokens. Its decode steps attend on the key/value heads
themselves (`sdpa_gqa_decode`; transformers' sdpa would copy each one per query head, the whole cache
every step). `auto` (default) is static on CUDA for models
whose cache can be static, dynamic otherwise (CPU; hybrid linear-attention models, whose recurrent
layers have no KV cache). Greedy rows are the same with either cache and any batch size (the tests
check it on CPU in fp32; on a GPU, kernels picked per shape may round differently); sampled rows
depend on the cache and the batch size (filler rows draw random numbers too), as they do on the seed.

Prompts are rendered with `data.chat_template_kwargs` (e.g. `{enable_thinking: false}`), the same
options training and `evaluate` render with. Each regenerated assistant turn records whether the
model ended it: `"finished": false` when it hit `max_new_tokens` before a stop token (training then
drops the row or keeps the reply open, `data.unfinished`). Reasoning the model writes in a `<think>`
block is stored as `reasoning_content` (the HF/OpenAI schema); the row's `tools`, if any, are kept.

Several processes, one GPU each: `torchrun --nproc-per-node N -m dflash_mp.regenerate ...` deals the
sorted windows out round-robin; each process appends its rows to `out.part<r>of<N>`, and once all are
done rank 0 merges them into `out` in input order (the same file one process writes, sampled rows
included: a batch's seed is its place in the work). Each batch logs rows, generated tokens/s and ETA.

Resumable: rows already in `out` (matched by their non-assistant turns) are skipped and new rows are
appended, flushed after every batch. Output rows are `{"messages": [...]}` (plus `tools` when the
input row had them). Bad input rows are counted by reason and skipped; counters `unfinished` (cut
replies) and `empty_replies` are printed.
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

from .cli import entry, tool_main
from .data.chat import render_chat, row_messages, row_tools

log = logging.getLogger(__name__)


@dataclass
class RegenConfig:
    out: str = ""  # output jsonl (appended to; rows already there are skipped)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling when temperature > 0
    max_new_tokens: int = 512  # per assistant turn
    # 128 rows: an 8B target reads its 16 GB of weights once per decode step whatever the batch, so below
    # ~100 rows the step costs about the same and yields fewer tokens; its KV cache (~147 KB a token) for
    # 128 rows of a 1k-token prompt plus 512 new tokens is ~29 GB, which fits an 80 GB GPU beside the weights.
    # Lower it for long prompts (or a small GPU): the static cache holds rows x (bucketed prompt + new tokens).
    batch_size: int = 128  # conversations generated together
    sort_window: int = 16  # batches whose conversations are sorted by length together; 1 = input order
    seed: int = 0  # sampling seed (per batch: seed + batch index)
    cache: str = "auto"  # KV cache: auto (static on CUDA where the model allows it), dynamic or static
    prompt_bucket: int = 256  # static cache: prompts left-padded to a multiple of this many tokens


def conversation_key(messages: list[dict]) -> str:
    """What regeneration leaves unchanged: the non-assistant turns and where the replies go."""
    return json.dumps([(m["role"], m["content"] if m["role"] != "assistant" else None) for m in messages])


def reply_message(text: str, finished: bool, split_reasoning: bool = True) -> dict:
    """The assistant message for a generated reply, `finished` recording whether a stop token ended it.

    With `split_reasoning` (templates that read `reasoning_content`), a leading `<think>` block (or
    reasoning closed by `</think>` when the prompt opened the block) becomes `reasoning_content`.
    A reply whose block never closes was cut while reasoning: it is unfinished whatever stopped it.
    """
    msg: dict = {"role": "assistant", "content": text}
    head, sep, tail = text.partition("</think>")
    if not sep and text.lstrip().startswith("<think>"):
        finished = False
        if split_reasoning:
            msg.update(reasoning_content=text.lstrip().removeprefix("<think>").strip("\n"), content="")
    elif sep and split_reasoning and (head.lstrip().startswith("<think>") or "<think>" not in head):
        msg.update(reasoning_content=head.lstrip().removeprefix("<think>").strip("\n"), content=tail.lstrip("\n"))
    msg["finished"] = finished
    return msg


def done_keys(path: str, repair: bool = True) -> Counter:
    """Keys of the rows already in `path`; a torn last line (a crash mid-write) is cut off first
    (`repair`; else only skipped: another process owns the file)."""
    keys: Counter = Counter()
    if not os.path.exists(path):
        return keys
    with open(path, "rb+" if repair else "rb") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if repair and end < len(data):
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


CACHES = ("auto", "dynamic", "static")
# Cache layers a static cache holds as fixed-size KV tensors; any other kind (a linear-attention layer's
# recurrent state) keeps such a model on the dynamic cache.
STATIC_LAYER_TYPES = {"full_attention", "sliding_attention"}


def static_cache_refusal(model) -> str | None:
    """Why `model` cannot generate with transformers' static KV cache, or None when it can."""
    if not getattr(type(model), "_can_compile_fullgraph", False):
        return f"{type(model).__name__} is not marked compilable by transformers (_can_compile_fullgraph)"
    config = model.config.get_text_config(decoder=True)
    other = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]) - STATIC_LAYER_TYPES)
    if other:
        return f"{type(model).__name__} has {', '.join(other)} layers (a recurrent state, not a KV cache)"
    return None


def check_cache(choice: str) -> None:
    if choice not in CACHES:
        raise ValueError(f"cache={choice!r} is not a cache; use one of {', '.join(CACHES)}")


def resolve_cache(choice: str, model, device: torch.device) -> str:
    """`cache=auto|dynamic|static` -> the cache regeneration generates with, "static" or "dynamic" (logged).

    A static cache pays where transformers compiles the decode step around it, which it does on CUDA
    only; elsewhere `auto` keeps the dynamic cache. A model that cannot hold a static cache falls
    back to the dynamic one."""
    check_cache(choice)
    refusal = static_cache_refusal(model) if choice != "dynamic" else None
    if choice == "dynamic":
        why = "asked for"
    elif refusal:
        why = f"not static: {refusal}"
    elif choice == "auto" and device.type != "cuda":
        why = f"auto on {device.type}: transformers compiles the static-cache decode step on CUDA only"
    else:
        log.info("regen: static KV cache (cache=%s): batches padded to batch_size rows and prompts to the bucket, "
                 "so the decode step that transformers compiles on CUDA keeps its shapes", choice)
        return "static"
    log.info("regen: dynamic KV cache (cache=%s; %s)", choice, why)
    return "dynamic"


# The static path's attention (registered with transformers under this name): sdpa, but a one-token
# query of a GQA layer attends on the key/value heads themselves.
GQA_DECODE = "regen_sdpa_gqa_decode"  # no "flash" in it: transformers reads that as flash attention


def sdpa_gqa_decode(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, except for a decode step (one query token) of a grouped-query layer:
    there its `groups` query heads per key/value head become `groups` query rows of that head, so
    the cache is read once. transformers repeats every key/value head `groups` times whenever a mask
    is given, as a static cache always needs (its unwritten slots are masked): compiled, that copies
    the whole cache `groups`-fold every step, the largest traffic of a big batch's decode step."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or (attention_mask is not None and attention_mask.shape[1] != 1):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    b, h, _, d = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, h // groups, groups, d), key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"))
    return out.reshape(b, 1, h, value.shape[-1]), None  # (batch, query length, heads, head dim), as sdpa's


def register_gqa_decode() -> str:
    """Register `sdpa_gqa_decode` (and sdpa's mask for it) with transformers, under GQA_DECODE."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(GQA_DECODE, sdpa_gqa_decode)
    AttentionMaskInterface.register(GQA_DECODE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return GQA_DECODE


def bucket_width(width: int, bucket: int) -> int:
    """`width` rounded up to a multiple of `bucket`."""
    return -(-width // bucket) * bucket


class Regenerator:
    def __init__(self, model, tokenizer, cfg: RegenConfig, chat_template_kwargs: dict | None = None,
                 cache: str = "dynamic", gqa_decode: bool = True):
        assert cache in ("dynamic", "static"), cache  # resolve_cache turns `auto` into one of them
        self.model, self.tok, self.cfg, self.cache = model, tokenizer, cfg, cache
        # The static path's attention: sdpa with GQA decode steps on the key/value heads (`gqa_decode`,
        # off only to measure transformers' own); other attentions are left as they are.
        self.attention = register_gqa_decode() if cache == "static" and gqa_decode \
            and model.config._attn_implementation == "sdpa" else model.config._attn_implementation
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.device = model.get_input_embeddings().weight.device
        self.stop = stop_token_ids(tokenizer, model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop[0]
        self.split_reasoning = "reasoning_content" in (tokenizer.chat_template or "")
        self.new_tokens = 0  # tokens generated so far (each reply up to its stop token; never a filler row's)
        self.shapes: set[tuple[int, int]] = set()  # static: (rows, cache length) of every call so far

    @torch.no_grad()
    def generate(self, prompts: list[list[dict]], tools: list[list | None] | None = None) -> list[tuple[str, bool]]:
        """(reply, finished) per conversation prefix, generated as one left-padded batch; `finished`
        is False when the reply ran into `max_new_tokens` without a stop token.

        With the static cache every call has the same rows (`batch_size`: filler rows, copies of the
        first prompt, make up the number and are dropped) and a bucketed prompt width, so the cache and
        the compiled decode step take one shape per bucket. Rows never mix (the attention of each is
        its own and greedy picks per row), and a copy stops when its original does."""
        tools = tools or [None] * len(prompts)
        ids = [render_chat(self.tok, p, self.chat_template_kwargs, True, t) for p, t in zip(prompts, tools)]
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] for t in ids]
        num_real, width = len(ids), max(len(x) for x in ids)
        extra = {}
        if self.cache == "static":
            assert num_real <= self.cfg.batch_size, (num_real, self.cfg.batch_size)
            ids += [ids[0]] * (self.cfg.batch_size - num_real)
            width = bucket_width(width, self.cfg.prompt_bucket)
            self._size_static_cache(len(ids), width + self.cfg.max_new_tokens - 1)
            extra["cache_implementation"] = "static"
        input_ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)
        sample = self.cfg.temperature > 0
        kwargs = dict(do_sample=True, temperature=self.cfg.temperature, top_p=self.cfg.top_p) if sample \
            else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        config, attention = self.model.config, self.model.config._attn_implementation
        config._attn_implementation = self.attention  # for this call only: the model may serve other callers
        try:
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=self.cfg.max_new_tokens,
                                      eos_token_id=self.stop, pad_token_id=self.pad, **kwargs, **extra)
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"out of memory generating {input_ids.shape[0]} rows of {width} prompt + {self.cfg.max_new_tokens} new "
                f"tokens ({self.cache} KV cache): lower regen.batch_size (now {self.cfg.batch_size}) or "
                f"regen.max_new_tokens; the rows written so far are kept and a rerun continues after them") from e
        finally:
            config._attn_implementation = attention
        stop = set(self.stop)
        replies = []
        for row in out[:num_real].tolist():  # filler rows end here
            new = row[width:]
            # Padding after a finished row may be a stop id too, but only ever after a real one.
            end = next((i for i, t in enumerate(new) if t in stop), None)
            self.new_tokens += len(new) if end is None else end + 1
            replies.append((self.tok.decode(new, skip_special_tokens=True).strip(), end is not None))
        return replies

    def _size_static_cache(self, rows: int, cache_len: int) -> None:
        """Before a static-cache call of `rows` x `cache_len`: the cache gets exactly that length, and
        Dynamo may compile once per such shape.

        transformers sizes a static cache to the longest call so far (`_previous_max_cache_length`, so
        that it need not recompile): a short batch after a long one would then attend over the long
        one's length. Forgetting it sizes each call to its own bucket; Dynamo marks the length dynamic
        at its second value, so the buckets cost one more compile, not one each. Should it specialise
        every shape instead, the recompile limit is raised to the number of shapes, so a bucket never
        drops the decode step to eager."""
        import torch._dynamo

        self.model._previous_max_cache_length = -1
        if (rows, cache_len) in self.shapes:
            return
        self.shapes.add((rows, cache_len))
        config = torch._dynamo.config
        if len(self.shapes) > config.recompile_limit:
            old = config.recompile_limit
            config.recompile_limit = 2 * len(self.shapes)
            config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * config.recompile_limit)
            log.info("regen: %d static-cache shapes so far: torch._dynamo.config.recompile_limit raised from %d to %d",
                     len(self.shapes), old, config.recompile_limit)

    def regenerate(self, conversations: list[list[dict]], tools: list[list | None] | None = None) -> list[list[dict]]:
        """Every assistant turn replaced, turn by turn; each turn sees the replies regenerated before it."""
        convs = [list(c) for c in conversations]
        tools = tools or [None] * len(convs)
        turn_idx = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
        for t in range(max(len(x) for x in turn_idx)):
            todo = [(c, x[t]) for c, x in zip(range(len(convs)), turn_idx) if t < len(x)]
            replies = self.generate([convs[c][:i] for c, i in todo], [tools[c] for c, _ in todo])
            for (c, i), (reply, finished) in zip(todo, replies):
                convs[c][i] = reply_message(reply, finished, self.split_reasoning)
        return convs


def regenerate_file(job, cfg: RegenConfig) -> Counter:
    """Regenerate `job.data` into `cfg.out`; returns counters (written, skipped_done, bad/<reason>)."""
    from transformers import AutoTokenizer

    from . import process_options
    from .data.chat import BadRow, ChatEncoder, load_conversations
    from .runtime import pick_device, resolve
    from .target import load_causal_lm, resolve_dtype

    if not cfg.out:
        raise ValueError("out= is missing; name the output jsonl, e.g. out=regenerated.jsonl")
    if min(cfg.batch_size, cfg.max_new_tokens, cfg.sort_window, cfg.prompt_bucket) < 1:
        raise ValueError(f"batch_size={cfg.batch_size}, max_new_tokens={cfg.max_new_tokens}, sort_window="
                         f"{cfg.sort_window}, prompt_bucket={cfg.prompt_bucket}: all must be >= 1")
    check_cache(cfg.cache)  # before the model loads (minutes for a large target)
    device = pick_device()  # under torchrun, one GPU per process
    job = resolve(job)
    process_options.apply(job.target, device, "target")  # as a run's target: before the first GEMM and compile
    path = job.target.path
    tok = AutoTokenizer.from_pretrained(path)
    model = load_causal_lm(path, device, resolve_dtype(job.target.dtype, device))  # builtin targets too
    # Every row is checked as training will read it, but a reply cut in the SOURCE data is no reason to
    # skip the row here: its turns are about to be replaced.
    encoder = ChatEncoder(tok, chat_template_kwargs=job.data.chat_template_kwargs, unfinished="keep_open")
    rank, world, group = shard_group()
    parts = [part_path(cfg.out, r, world) for r in range(world)] if world > 1 else []
    # Each process repairs only the files it writes (rank 0 the output); all read every file after.
    if rank == 0:
        done_keys(cfg.out)
    if parts:
        done_keys(parts[rank])
        torch.distributed.barrier(group)
    done = done_keys(cfg.out, repair=False)
    for p in parts:
        done.update(done_keys(p, repair=False))
    stats: Counter = Counter()
    todo = []
    for n, row in enumerate(load_conversations(job.data)):
        try:
            messages = row_messages(row, job.data.messages_field)
            tools = row_tools(row)
            encoder.encode_messages(messages, tools=tools)  # the trainer's own checks (template, rendering)
        except BadRow as bad:
            stats[f"bad/{bad.reason}"] += 1
            continue
        key = conversation_key(messages)
        if done[key] > 0:
            done[key] -= 1
            stats["skipped_done"] += 1
            continue
        todo.append((messages, tools, n))
    regen = Regenerator(model, tok, cfg, job.data.chat_template_kwargs, cache=resolve_cache(cfg.cache, model, device))
    dest = parts[rank] if parts else cfg.out
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    t0 = time.perf_counter()
    window = cfg.batch_size * cfg.sort_window
    # Windows are dealt out round-robin: every process builds the same `todo`, and a batch's seed
    # depends on its place in it, so N processes write what one would (merged in input order below).
    mine = [w0 for i, w0 in enumerate(range(0, len(todo), window)) if i % world == rank]
    total = sum(len(todo[w0: w0 + window]) for w0 in mine)
    generated = 0  # rows generated so far; a window's rows are written once all of it is done

    def progress() -> None:  # after every batch: rows, generated tokens/s, ETA
        dt = time.perf_counter() - t0
        log.info("%s%d/%d rows generated (%d written), %.0f tokens/s, %.1f s, ETA %.0f s",
                 f"rank {rank}: " if parts else "", generated, total, stats["written"], regen.new_tokens / dt, dt,
                 (total - generated) * dt / max(generated, 1))

    with open(dest, "a", encoding="utf-8") as f:
        for w0 in mine:
            chunk = todo[w0: w0 + window]
            sizes = [(sum(m["role"] == "assistant" for m in msgs),
                      len(render_chat(tok, msgs, job.data.chat_template_kwargs, tools=tools)))
                     for msgs, tools, _ in chunk]
            order = sorted(range(len(chunk)), key=lambda i: sizes[i], reverse=True)
            done: list = [None] * len(chunk)
            for start in range(0, len(order), cfg.batch_size):
                # Seeded by the batch's place in the remaining work AND what was already done (whole
                # windows: a window is written at once), so a resumed run continues the uninterrupted
                # run's seed sequence.
                torch.manual_seed(cfg.seed + stats["skipped_done"] + w0 + start)
                idx = order[start: start + cfg.batch_size]
                convs = regen.regenerate([chunk[i][0] for i in idx], [chunk[i][1] for i in idx])
                for i, conv in zip(idx, convs):
                    done[i] = conv
                generated += len(idx)
                progress()
            for conv, (_, tools, n) in zip(done, chunk):
                replies = [m for m in conv if m["role"] == "assistant"]
                stats["empty_replies"] += sum(not m["content"] and not m.get("reasoning_content") for m in replies)
                stats["unfinished"] += sum(not m["finished"] for m in replies)
                row = {"messages": conv, **({"tools": tools} if tools else {}), **({"_row": n} if parts else {})}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                stats["written"] += 1
            f.flush()
            os.fsync(f.fileno())
    stats["new_tokens"] = regen.new_tokens
    if parts:
        stats = merge_parts(cfg.out, parts, stats, rank, group)
    return stats


def shard_group():
    """(rank, world size, gloo group) under torchrun (WORLD_SIZE > 1), else (0, 1, None)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), world, dist.group.WORLD


def part_path(out: str, rank: int, world: int) -> str:
    return f"{out}.part{rank}of{world}"


def merge_parts(out: str, parts: list[str], stats: Counter, rank: int, group) -> Counter:
    """Once every process has written its windows: rank 0 appends the parts' rows to `out` in input
    order and removes the parts. Returns the summed counters (rank 0; the others' own)."""
    import torch.distributed as dist

    gathered: list = [None] * len(parts)
    dist.all_gather_object(gathered, dict(stats), group=group)
    if rank == 0:
        rows = []
        for p in parts:
            if os.path.exists(p):
                rows += [json.loads(line) for line in open(p, encoding="utf-8") if line.strip()]
        rows.sort(key=lambda r: r.pop("_row"))
        with open(out, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for p in parts:
            if os.path.exists(p):
                os.remove(p)
        # Every process read the whole data set (bad and done rows alike); each wrote its own rows.
        for g in gathered[1:]:
            stats.update({k: g.get(k, 0) for k in ("written", "unfinished", "empty_replies", "new_tokens")})
    dist.barrier(group)  # no process leaves before the merge is on disk
    return stats


def regenerate_command(job, cfg: RegenConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(levelname)s %(name)s] %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    stats = regenerate_file(job, cfg)
    if shard_group()[0] == 0:  # one line per job (rank 0 sums the shards')
        print(json.dumps(dict(stats), sort_keys=True))


def main(argv: list[str] | None = None) -> None:
    tool_main("regen", RegenConfig, regenerate_command, __doc__, argv)


if __name__ == "__main__":
    entry(main)
