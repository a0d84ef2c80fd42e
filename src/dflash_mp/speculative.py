"""Greedy block-verify speculative decoding with a DFlash drafter against a Hugging Face target.

One step, with `start` = position of the last accepted token `t` (its hidden state does not exist
yet): the drafter reads the target's captured hidden states of positions `< start` and the block
`[t, MASK x (B-1)]` at positions `start .. start+B-1`, and proposes B-1 tokens (argmax through the
target's LM head). The target runs the whole block in one forward over its KV cache; the longest
prefix of proposals equal to the target's own argmax is accepted, plus the target's next token
(the bonus), so every target forward yields 1..B tokens. Rejected positions are cropped from the
cache, and the hidden states of the accepted positions join the drafter's context.

Hybrid targets (Qwen3.5's linear-attention layers) keep a recurrent state that has folded in the
whole block and cannot be cropped: their states are saved before each verify forward and, when a
proposal is rejected, put back and advanced over the accepted tokens alone by one more forward
(`SpecResult.num_rollback_forwards`), so the cache holds exactly what greedy decoding would.

The drafter is recomputed over the whole context every step (no drafter KV cache): sizes here are
small, and this keeps the drafter call identical to training (`DFlashDrafter.forward` with one
anchor and the training mask), so what training measured is what decoding sees.

Greedy verification is lossless: the output must equal plain greedy decoding token for token.
`check_lossless` enforces it.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .block_mask import mask_grid
from .model import FULL_ATTENTION, SLIDING_ATTENTION, BlockAttention, DFlashDrafter, DrafterArgs, make_mask_mod


@dataclass
class SpecResult:
    """One prompt's speculative decode."""

    tokens: list[int]  # generated ids (the stop token included when one was produced)
    acceptance_lengths: list[int]  # tokens gained per verify forward (accepted proposals + 1), after clipping
    num_target_forwards: int  # prefill + verify forwards
    seconds: float = 0.0  # wall-clock of the decode
    num_rollback_forwards: int = 0  # hybrid targets: forwards re-advancing recurrent state past a rejection

    @property
    def tau(self) -> float:
        """Mean tokens per verify forward (1 = no proposal ever accepted, B = all of them)."""
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


@dataclass
class GreedyResult:
    tokens: list[int]
    num_target_forwards: int
    seconds: float = 0.0


@dataclass
class Drafter:
    """A drafter plus the frozen target pieces it borrows (embedding rows, LM head)."""

    model: DFlashDrafter
    args: DrafterArgs
    embed: torch.Tensor  # [V, H] the target's input embedding
    head: torch.Tensor  # [V, H] the target's LM head

    @classmethod
    def for_target(cls, model: DFlashDrafter, args: DrafterArgs, target) -> "Drafter":
        """Borrow embedding and LM head from a loaded HF target; move the drafter to its device/dtype."""
        embed = target.get_input_embeddings().weight.detach()
        head = target.get_output_embeddings().weight.detach()
        if embed.shape[0] != args.vocab_size or embed.shape[1] != args.hidden_size:
            raise ValueError(
                f"drafter expects vocab {args.vocab_size} x hidden {args.hidden_size}, the target's embedding is "
                f"{tuple(embed.shape)}: was this drafter trained for another target?")
        model = model.to(device=embed.device, dtype=embed.dtype).eval()
        return cls(model, args, embed, head)


def capture(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """`[S, K*H]` context rows: layer i is the output of decoder layer i, `hidden_states[i + 1]`."""
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of an HF cache (the crop signature changed in transformers 5)."""
    current = cache.get_seq_length()
    if current <= length:
        return
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(length - current)  # negative: remove that many tokens from the end
    else:
        cache.crop(length)


def _recurrent_layers(cache) -> list:
    """The cache layers holding linear-attention (recurrent) state, which `crop` cannot roll back."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:  # transformers without hybrid caches
        return []
    return [layer for layer in getattr(cache, "layers", []) if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _save_states(layers: list) -> list[tuple[dict, dict, dict]]:
    return [({i: t.clone() for i, t in layer.conv_states.items() if t is not None},
             {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None},
             dict(layer.has_previous_state)) for layer in layers]


def _restore_states(layers: list, saved: list[tuple[dict, dict, dict]]) -> None:
    for layer, (conv, rec, previous) in zip(layers, saved):
        for i, t in conv.items():
            layer.conv_states[i].copy_(t)  # in place: the cache's tensors keep their addresses
        for i, t in rec.items():
            layer.recurrent_states[i].copy_(t)
        layer.has_previous_state.update(previous)


def _crop_attention(cache, length: int) -> None:
    """`_crop` for a hybrid cache: only the attention layers' KV rows (recurrent layers are restored)."""
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            extra = layer.get_seq_length() - length
            if extra > 0:
                DynamicLayer.crop(layer, -extra)


def _new_cache(target):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.config)
    except TypeError:  # transformers 4.x takes no config
        return DynamicCache()


def inference_attention(args: DrafterArgs, start: int, block_size: int, device) -> BlockAttention:
    """The training mask for one block anchored at `start` over a context of `start + 1` rows.

    The training `mask_mod` itself, evaluated on broadcast index grids (what `create_mask` computes,
    without its per-element vmap, which dominates a decode step at these sizes).
    """
    anchors = torch.tensor([start], device=device)
    valid = torch.ones(1, dtype=torch.bool, device=device)
    doc_ids = torch.zeros(start + 1, dtype=torch.long, device=device)

    def dense(window):
        mod = make_mask_mod(anchors, valid, doc_ids, start + 1, block_size, window)
        return mask_grid(mod, block_size, start + 1 + block_size, device)[None, None]

    kinds = set(args.resolved_layer_types)
    return BlockAttention(backend="dense", full=dense(None) if FULL_ATTENTION in kinds else None,
                          sliding=dense(args.sliding_window) if SLIDING_ATTENTION in kinds else None)


@torch.no_grad()
def draft_block(drafter: Drafter, context: torch.Tensor, anchor_token: int, block_size: int) -> torch.Tensor:
    """B-1 proposed ids `[B-1]` for the block anchored after `context` (`[start, K*H]`, start >= 1).

    The training mask needs the anchor's own row to exist (it indexes `doc_ids[anchor]`); a zero row
    is appended for it, and the mask (`p < anchor`) keeps it invisible, exactly as in training.
    """
    start, device = context.shape[0], context.device
    hidden = torch.cat([context, context.new_zeros(1, context.shape[1])])
    attn = inference_attention(drafter.args, start, block_size, device)
    block = torch.full((block_size,), drafter.args.mask_token_id, dtype=torch.long, device=device)
    block[0] = anchor_token
    out = drafter.model(hidden, F.embedding(block, drafter.embed), torch.arange(start + 1, device=device),
                        torch.arange(start, start + block_size, device=device), attn)
    return F.linear(out[1:], drafter.head).argmax(dim=-1)


def _finish(tokens: list[int], new: list[int], max_new_tokens: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    """Append `new` to `tokens` up to the first stop token or the length limit; returns (appended, done)."""
    taken = []
    for t in new:
        if len(tokens) + len(taken) >= max_new_tokens:
            return taken, True
        taken.append(t)
        if t in stop_ids:
            return taken, True
    return taken, len(tokens) + len(taken) >= max_new_tokens


@torch.no_grad()
def speculative_generate(target, drafter: Drafter, prompt_ids: list[int] | torch.Tensor, max_new_tokens: int,
                         stop_ids: set[int] | list[int] = (), block_size: int | None = None) -> SpecResult:
    """Greedy speculative decoding of one prompt (batch 1). `target` is a full HF causal LM."""
    b = block_size or drafter.args.block_size
    if b < 2:
        raise ValueError(f"block_size={b} leaves no slot to draft; use >= 2")
    stop_ids = set(stop_ids)
    layer_ids = drafter.args.target_layer_ids
    device = drafter.embed.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    if prompt.shape[1] < 1:
        raise ValueError("the prompt is empty; speculative decoding needs at least one token")
    t0 = time.perf_counter()
    cache = _new_cache(target)
    out = target(input_ids=prompt, past_key_values=cache, use_cache=True, output_hidden_states=True)
    context = capture(out.hidden_states, layer_ids)  # positions 0 .. start-1
    tokens: list[int] = []
    first, done = _finish(tokens, [int(out.logits[0, -1].argmax())], max_new_tokens, stop_ids)
    tokens += first
    lengths: list[int] = []
    forwards, rollbacks = 1, 0
    recurrent = _recurrent_layers(cache)
    while not done:
        start = context.shape[0]
        last = tokens[-1]
        proposal = draft_block(drafter, context, last, b)
        block = torch.cat([torch.tensor([last], device=device), proposal])[None]
        positions = torch.arange(start, start + b, device=device)[None]
        saved = _save_states(recurrent) if recurrent else None
        out = target(input_ids=block, position_ids=positions, past_key_values=cache, use_cache=True,
                     output_hidden_states=True)
        forwards += 1
        verified = out.logits[0].argmax(dim=-1)  # verified[j] = the target's token at start + j + 1
        match = (proposal == verified[:-1]).long()
        accepted = int(match.cumprod(0).sum())
        new = proposal[:accepted].tolist() + [int(verified[accepted])]
        taken, done = _finish(tokens, new, max_new_tokens, stop_ids)
        tokens += taken
        lengths.append(len(taken))
        # The block's tokens at start .. start+accepted are now part of the sequence: keep their
        # hidden states and cache rows, drop the rejected rest.
        context = torch.cat([context, capture(out.hidden_states, layer_ids)[: accepted + 1]])
        if not recurrent:
            _crop(cache, start + accepted + 1)
        elif accepted + 1 < b and not done:
            _restore_states(recurrent, saved)
            _crop_attention(cache, start)
            target(input_ids=block[:, : accepted + 1], position_ids=positions[:, : accepted + 1],
                   past_key_values=cache, use_cache=True, logits_to_keep=1)
            rollbacks += 1
    return SpecResult(tokens, lengths, forwards, time.perf_counter() - t0, rollbacks)


@torch.no_grad()
def greedy_generate(target, prompt_ids: list[int] | torch.Tensor, max_new_tokens: int,
                    stop_ids: set[int] | list[int] = ()) -> GreedyResult:
    """Plain greedy decoding, one token per target forward over a KV cache (the lossless reference)."""
    stop_ids = set(stop_ids)
    device = target.get_input_embeddings().weight.device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    t0 = time.perf_counter()
    cache = _new_cache(target)
    tokens: list[int] = []
    forwards = 0
    pos = 0
    while len(tokens) < max_new_tokens:
        positions = torch.arange(pos, pos + ids.shape[1], device=device)[None]
        out = target(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
        forwards += 1
        pos += ids.shape[1]
        t = int(out.logits[0, -1].argmax())
        tokens.append(t)
        if t in stop_ids:
            break
        ids = torch.tensor([[t]], device=device)
    return GreedyResult(tokens, forwards, time.perf_counter() - t0)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_lossless(index: int, spec: SpecResult, greedy: GreedyResult) -> None:
    """Raise RuntimeError naming the prompt and the first differing position if the outputs differ."""
    pos = first_difference(spec.tokens, greedy.tokens)
    if pos is not None:
        got = spec.tokens[pos] if pos < len(spec.tokens) else "<end>"
        want = greedy.tokens[pos] if pos < len(greedy.tokens) else "<end>"
        raise RuntimeError(
            f"speculative decoding is not lossless on prompt {index}: first difference at generated position "
            f"{pos} (speculative {got}, greedy {want}; lengths {len(spec.tokens)} vs {len(greedy.tokens)}). "
            "In bf16/fp16 a near-tie between two logits can flip between a block forward and a one-token "
            "forward; rerun in float32 to tell a numerical tie from a bug.")
