"""The local tokenizer and the tiny and random-weight targets built from configs (`builtin:tiny-qwen3`,
`builtin:random-*`). Nothing here touches the network.

`builtin:random-qwen3-8b` (and `builtin:random-tiny-qwen3`, its CPU-test stand-in) is a target with
real shapes and random weights that are never stored: the built directory holds config.json, the demo
tokenizer and `random_init.json` (a seed), and `target.TargetWorker.load` draws the weights on the
target device at load time. Realistic-shape GPU benchmarks of the whole pipeline need no download.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING

import torch

from ..archs import hf_config
from ..fsutil import write_atomic
from ..target import RANDOM_INIT

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# transformers is imported inside the builders: resolving a name that is already built should not pay
# for loading the model zoo (seconds per process).

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TINY_QWEN3 = dict(
    hidden_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    max_position_embeddings=4096,
)


def build_demo_tokenizer(texts: list[str], vocab_size: int = 1536) -> "PreTrainedTokenizerFast":
    """Byte-level BPE trained on `texts`, with ChatML special tokens and a Qwen-style template.

    Byte-level so that any string round-trips (bad-row tests feed it arbitrary unicode).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts + ["system", "user", "assistant"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def demo_qwen3_config(tokenizer, **sizes):
    """Qwen3Config of TINY_QWEN3 overridden by `sizes`, with `tokenizer`'s special ids and untied
    embeddings. The default vocab has spare rows past the tokenizer (like Qwen3) so a drafter can use
    one as its mask token."""
    from transformers import Qwen3Config

    # rope_theta is an argument that transformers 5 folds into rope_parameters (no attribute of that name).
    unknown = sorted(k for k in sizes if k != "rope_theta" and not hasattr(Qwen3Config(), k))
    if unknown:
        raise ValueError(f"unknown Qwen3Config fields {unknown}; pass fields such as {sorted(TINY_QWEN3)}")
    vocab_size = math.ceil((len(tokenizer) + 8) / 64) * 64
    fields = {"vocab_size": vocab_size, **TINY_QWEN3, "tie_word_embeddings": False, **sizes}
    return Qwen3Config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=None, **fields)


def build_demo_target(out_dir: str, tokenizer, seed: int = 0, **sizes) -> str:
    """Write a randomly initialised tiny Qwen3 plus `tokenizer` to `out_dir` (atomically); returns it."""
    from transformers import AutoModelForCausalLM

    config = demo_qwen3_config(tokenizer, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)

    def save(tmp: str) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_atomic(out_dir, save)


def build_random_target(out_dir: str, tokenizer, seed: int = 0, **sizes) -> str:
    """Write config.json, `tokenizer` and the random-init marker, no weights, to `out_dir` (atomically).

    Weights of 8B shapes take seconds to draw on a GPU but minutes to write and read back, so they are
    drawn at load time instead (target.TargetWorker.load, target.load_target_head).
    """
    return _write_random_target(out_dir, demo_qwen3_config(tokenizer, **sizes), tokenizer, seed)


def build_random_arch_target(out_dir: str, tokenizer, fields: dict, seed: int = 0) -> str:
    """`build_random_target` for an architecture of archs.HF_ARCHS / TINY_ARCHS (hybrid, MoE): its own
    config class, the demo tokenizer's special ids, and the demo vocabulary where `fields` name none."""
    vocab_size = fields.get("vocab_size") or math.ceil((len(tokenizer) + 8) / 64) * 64
    config = hf_config(fields, vocab_size=vocab_size, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return _write_random_target(out_dir, config, tokenizer, seed)


def _write_random_target(out_dir: str, config, tokenizer, seed: int) -> str:
    def save(tmp: str) -> None:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, RANDOM_INIT), "w") as f:
            json.dump({"seed": seed}, f)

    return write_atomic(out_dir, save)
