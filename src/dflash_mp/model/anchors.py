"""Anchor sampling, block inputs and block labels for one packed row.

Everything here runs on the row's device with shapes fixed by `(T, A, B)`: no `.item()`, no
data-dependent `nonzero`, no Python loop over tokens, so a compiled train step traces it without a
graph break and never recompiles.
"""

from __future__ import annotations

import torch

# Random keys are 31-bit so that (doc_id + 1) * 2**31 + key stays exact in int64 for any T.
_KEY_BITS = 31


def anchor_candidates(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """`[T]` bool: a can anchor a block iff a and a+1 are supervised and a+1 is in a's document."""
    supervised = loss_mask.bool() & (doc_ids >= 0)
    next_supervised = torch.cat([supervised[1:], supervised.new_zeros(1)])
    next_doc = torch.cat([doc_ids[1:], doc_ids.new_full((1,), -1)])
    return supervised & next_supervised & (next_doc == doc_ids)


def sample_anchors(
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    num_anchors: int,
    max_per_doc: int | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to `max_per_doc` candidates per document, then up to `num_anchors` overall.

    `noise` ([2, T] uniform in [0, 1)) replaces the two internal random draws: the trainer draws it
    outside the compiled region, so eager, compiled and reference runs pick identical anchors.

    Both draws are uniform without replacement. Returns `(anchors [A] int64, valid [A] bool)`:
    valid anchors ascending first (sorted anchors keep the flex block mask dense), then invalid
    slots at position 0. Pass `generator=None` inside `torch.compile` (Dynamo does not trace
    explicit generators); the global RNG is used then.
    """
    T = doc_ids.shape[0]
    device = doc_ids.device
    cand = anchor_candidates(loss_mask, doc_ids)
    positions = torch.arange(T, device=device)

    if max_per_doc is not None:
        # Rank candidates inside their document by a random key: sorting on (doc, key) groups each
        # document's candidates in random order, and a candidate is kept if its rank < cap.
        if noise is not None:
            key = (noise[0].double() * 2**_KEY_BITS).long().clamp(max=2**_KEY_BITS - 1)
        else:
            key = torch.randint(0, 2**_KEY_BITS, (T,), device=device, generator=generator)
        key = torch.where(cand, ((doc_ids + 1) << _KEY_BITS) + key, torch.iinfo(torch.int64).max)
        order = torch.sort(key).indices
        sorted_doc = doc_ids[order]
        starts = torch.cat([sorted_doc.new_ones(1, dtype=torch.bool), sorted_doc[1:] != sorted_doc[:-1]])
        group_start = torch.where(starts, positions, 0).cummax(0).values
        kept_sorted = cand[order] & (positions - group_start < max_per_doc)
        cand = torch.zeros_like(cand).scatter(0, order, kept_sorted)

    # Uniform subset of the kept candidates: the k smallest of i.i.d. random priorities.
    priority = noise[1] if noise is not None else torch.rand(T, device=device, generator=generator)
    priority = torch.where(cand, priority, 2.0)
    k = min(num_anchors, T)
    pick = torch.topk(priority, k, largest=False).indices
    valid = cand[pick]
    # Valid anchors ascending, invalid ones after them.
    order_key = torch.sort(torch.where(valid, pick, pick + T)).values
    valid = order_key < T
    anchors = torch.where(valid, order_key, 0)
    if k < num_anchors:
        pad = num_anchors - k
        anchors = torch.cat([anchors, anchors.new_zeros(pad)])
        valid = torch.cat([valid, valid.new_zeros(pad)])
    return anchors, valid


def build_blocks(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block i = `[input_ids[a_i], mask x (B-1)]` at positions `position_ids[a_i] + 0..B-1`.

    Returns `(block_ids [A*B], block_positions [A*B])`, both int64.
    """
    slots = torch.arange(block_size, device=anchors.device)
    num_blocks = anchors.shape[0]
    block_ids = torch.full((num_blocks, block_size), mask_token_id, dtype=torch.long, device=anchors.device)
    block_ids[:, 0] = input_ids[anchors]
    block_positions = position_ids[anchors][:, None] + slots[None, :]
    return block_ids.reshape(-1), block_positions.reshape(-1)


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot k of block i predicts `input_ids[a_i + k]`; returns `(labels [A,B] int64, mask [A,B] bool)`.

    A label is supervised iff its anchor is valid, `a + k < T`, `a + k` is in the anchor's document
    and `loss_mask[a + k] == 1`. Slot 0 (the anchor token itself) never is. Unsupervised labels are
    0 so that they are always valid vocabulary indices.
    """
    T = input_ids.shape[0]
    slots = torch.arange(block_size, device=anchors.device)
    idx = anchors[:, None] + slots[None, :]
    in_range = idx < T
    idx = idx.clamp(max=T - 1)
    mask = (
        valid[:, None]
        & in_range
        & (slots[None, :] >= 1)
        & (doc_ids[idx] == doc_ids[anchors][:, None])
        & loss_mask[idx].bool()
    )
    labels = torch.where(mask, input_ids[idx], 0)
    return labels, mask
