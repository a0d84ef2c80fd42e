"""The tiny drafter shape the model and export tests share."""

from dflash_mp.model import DrafterArgs


def tiny_args(**overrides) -> DrafterArgs:
    """Defaults for every field; `vocab_size` also moves the default mask token to its last row."""
    vocab = overrides.get("vocab_size", 64)
    kwargs = dict(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  vocab_size=vocab, target_layer_ids=[1, 3, 5], mask_token_id=vocab - 1, block_size=4)
    kwargs.update(overrides)
    return DrafterArgs(**kwargs)
