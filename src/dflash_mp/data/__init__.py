"""Data pipeline: chat conversations -> tokens with an assistant loss mask -> fixed-shape packed rows."""

from dflash_mp.data.chat import (
    BadRow,
    ChatEncoder,
    load_conversations,
    normalize_messages,
    tokenize_conversation,
    tokenize_dataset,
)
from dflash_mp.data.packing import check_batch, pack_rows, plan_batches
from dflash_mp.data.stream import DataConfig, ShardStream, build_stream, split_eval

__all__ = [
    "BadRow",
    "ChatEncoder",
    "DataConfig",
    "ShardStream",
    "build_stream",
    "check_batch",
    "load_conversations",
    "normalize_messages",
    "pack_rows",
    "plan_batches",
    "split_eval",
    "tokenize_conversation",
    "tokenize_dataset",
]
