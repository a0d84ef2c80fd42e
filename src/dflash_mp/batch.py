"""The two batch types that cross module boundaries.

`PackedBatch` leaves the data pipeline (CPU tensors, one packed row of `seq_len` tokens).
`HiddenBatch` leaves the target forward and crosses the transport to a drafter rank.
Every tensor has a fixed shape for a run, so nothing downstream recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Header flags carried with every HiddenBatch.
FLAG_END_OF_DATA = 1

# Fields of the token tensors, in the order the transport packs them.
TOKEN_FIELDS = ("input_ids", "position_ids", "doc_ids", "loss_mask")


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """[T] int64: the first position of each token's document in a packed row (a run of equal ids is one
    document; trailing padding, id -1, is one of its own). On the row's device, no host sync."""
    pos = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[1:] = doc_ids[1:] != doc_ids[:-1]
    return torch.where(first, pos, 0).cummax(0).values


@dataclass
class PackedBatch:
    """Whole conversations packed into one row of `seq_len` tokens.

    Padding has `doc_ids == -1`, `loss_mask == 0`, `input_ids == pad_id`, `position_ids == 0`.
    """

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarts at 0 for every document
    doc_ids: torch.Tensor  # [T] int64, 0..num_docs-1, -1 on padding
    loss_mask: torch.Tensor  # [T] int64, 1 on assistant tokens only
    num_docs: int  # documents in this row
    num_valid_tokens: int  # non-padding tokens

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[0]


def join_rows(rows: list[PackedBatch]) -> PackedBatch:
    """Packed rows laid end to end as one row, for one forward over them all (`target.rows_per_forward`).
    Each row's documents get ids after the previous row's, and its padding an id of its own after its
    documents: a run of equal ids is one document to every attention and linear-attention kernel, so
    no token sees past its own row's document, and one row's padding never meets another's."""
    ids, offset = [], 0
    for r in rows:
        d = r.doc_ids
        n = int(d.max()) + 1 if d.numel() else 0  # the row's documents are 0..n-1 (a host row: no sync)
        ids.append(torch.where(d >= 0, d, n) + offset)
        offset += n + 1
    return PackedBatch(
        input_ids=torch.cat([r.input_ids for r in rows]),
        position_ids=torch.cat([r.position_ids for r in rows]),
        doc_ids=torch.cat(ids),
        loss_mask=torch.cat([r.loss_mask for r in rows]),
        num_docs=sum(r.num_docs for r in rows),
        num_valid_tokens=sum(r.num_valid_tokens for r in rows),
    )


@dataclass
class HiddenBatch:
    """Captured target hidden states plus the token tensors they belong to."""

    hidden: torch.Tensor  # [T, K*H], concat of the K captured layers (bf16 on GPU, fp32 on CPU)
    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64
    doc_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] int64
    seq: int = 0  # sequence number on its (target, drafter) pair, from 0
    num_valid_tokens: int = 0
    flags: int = 0  # FLAG_* bits

    @property
    def end_of_data(self) -> bool:
        return bool(self.flags & FLAG_END_OF_DATA)

    def to(self, device: torch.device | str, non_blocking: bool = False, copy: bool = False) -> "HiddenBatch":
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking, copy=copy)

        return HiddenBatch(
            hidden=move(self.hidden),
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            doc_ids=move(self.doc_ids),
            loss_mask=move(self.loss_mask),
            seq=self.seq,
            num_valid_tokens=self.num_valid_tokens,
            flags=self.flags,
        )
