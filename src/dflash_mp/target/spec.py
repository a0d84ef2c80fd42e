"""What a target is, read from its config alone (no weights): the job's `target.*` options, the
decoder's shape facts, the captured layers and the mask token."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from ..flops import num_experts


@dataclass
class TargetConfig:
    path: str = "builtin:tiny-qwen3"  # HF hub id or local dir; builtin:* = built locally (dflash_mp.builtin)
    layer_ids: list[int] | None = None  # captured layers; None = num_capture layers spread over 1..L-3
    num_capture: int = 5  # K, used when layer_ids is None
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float16 | float32
    # auto (the Triton packed-document kernel on CUDA where it has tiles for the head size, else flex_attention
    # or sdpa; sdpa on CPU) | triton | sdpa | flex_attention | varlen (FlashAttention-2's varlen kernel on the
    # row's documents; CUDA, bf16/fp16, torch >= 2.10) | eager
    attn_implementation: str = "auto"
    compile: bool = True  # torch.compile the truncated forward on CUDA (ignored on CPU)
    cache_dir: str = ""  # where builtin targets are built once; "" = $DFLASH_MP_CACHE or ~/.cache/dflash_mp
    packing_check: bool = True  # at load, refuse a target whose packed rows leak across documents
    # Replay the forward as one CUDA graph where it can be captured (target/graph.py: the Triton attention,
    # no linear-attention or MoE layers); false launches it from Python each time.
    cuda_graph: bool = True
    # Fold each compiled layer's RMSNorm weights into the projections that read the norm (target/fold.py):
    # the normed rows are never written (1.7 GB a forward at 8B shapes); kept per layer where the folded
    # output equals the layer's own to rounding (checked at load). CUDA compiled layers laid out as Llama's.
    fold_norms: bool = False
    # Ranks per target replica: >1 splits the target's layers over that many consecutive ranks of one
    # node (a target larger than one GPU), balanced by forward cost; see stages.py.
    stages: int = 1
    # Packed rows per forward: >1 lays that many rows end to end in one forward (their documents kept
    # apart), so each matmul gets rows x data.seq_len rows; the drafters still get one row per message.
    # Needs target.stages=1. For an 8B target on an H100/H200 it gains nothing (its GEMMs run no faster
    # at 6144 rows than at 3072, BENCHMARKS.md); a small target's GEMMs may.
    rows_per_forward: int = 1
    # cuBLAS's workspace in the target's process (blas.py): none (the default on CUDA: the 8B target's
    # GEMMs run without the memsets and gaps a workspace brings, BENCHMARKS.md calls G4-G5) | torch
    # (PyTorch's sizes). Environment variables already set win.
    cublas_workspace: str = "none"
    # How Inductor picks each compiled reduction kernel's config (reductions.py): heuristic (the default on
    # CUDA: from the kernel's shape, the same in every compile) | timed (timed at the kernel's first run,
    # whose picks for the 8B target's query/key norm kernels varied threefold from compile to compile).
    reduction_configs: str = "heuristic"


def rope_from_config(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of an HF config dict, whether RoPE lives in `rope_theta` /
    `rope_scaling` (transformers 4) or in `rope_parameters` (transformers 5)."""
    rope_scaling = config.get("rope_scaling")
    rope_theta = config.get("rope_theta")
    params = config.get("rope_parameters")
    if params:
        rope_theta = params.get("rope_theta", rope_theta)
        if params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return (rope_theta if rope_theta is not None else 1e6), rope_scaling


@dataclass(frozen=True)
class TargetSpec:
    """The shape facts of a decoder config dict, read once: HF configs leave kv heads and head_dim out
    when they are the defaults, and keep RoPE in one of two places by transformers version."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    sliding_window: int | None  # the window of its sliding-attention layers; None when it has none
    # The MLP width a token's activations take: a mixture of experts' routed experts together (those a token
    # visits times their width), else intermediate_size.
    token_mlp_width: int
    tied_embeddings: bool  # one tensor for the embedding and the LM head

    @classmethod
    def from_config(cls, config: dict) -> "TargetSpec":
        heads = config["num_attention_heads"]
        rope_theta, rope_scaling = rope_from_config(config)
        sliding = "sliding_attention" in (config.get("layer_types") or [])
        dense = config.get("intermediate_size") or 0  # 0: a MoE config with no dense MLP width
        routed = config["moe_intermediate_size"] * config["num_experts_per_tok"] if num_experts(config) else 0
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            intermediate_size=dense,
            vocab_size=config["vocab_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 40960),
            sliding_window=config.get("sliding_window") if sliding else None,
            token_mlp_width=routed or dense,
            tied_embeddings=bool(config.get("tie_word_embeddings")),
        )


def capture_layer_ids(cfg: TargetConfig, num_layers: int) -> list[int]:
    """The captured layers, sorted: `target.layer_ids`, or `num_capture` spread by `default_layer_ids`."""
    layer_ids = list(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(num_layers, cfg.num_capture)
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad or len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"target.layer_ids={layer_ids}: ids must be distinct and in 0..{num_layers - 1} "
                         f"for a target with {num_layers} layers.")
    return sorted(layer_ids)


def mask_token_id(configured: int | None, tokenizer_len: int, vocab_size: int) -> int:
    """`drafter.mask_token_id`, by default the first embedding row past the tokenizer (an id the data
    never holds; Qwen3's vocab has spare rows there)."""
    if configured is None:
        if tokenizer_len >= vocab_size:
            raise ValueError(f"the target's embedding has no spare row past its tokenizer (len {tokenizer_len}, "
                             f"vocab_size {vocab_size}): set drafter.mask_token_id to an id the data never uses.")
        return tokenizer_len
    if not 0 <= configured < vocab_size:
        raise ValueError(f"drafter.mask_token_id={configured} is outside the target vocabulary 0..{vocab_size - 1}.")
    return configured


def default_layer_ids(num_layers: int, k: int) -> list[int]:
    """K ids spread evenly from 1 to L-3 (Qwen3-8B, L=36, K=5: [1, 9, 17, 25, 33])."""
    hi = num_layers - 3
    if k < 1 or hi < 1 or k > hi:
        raise ValueError(
            f"target.num_capture={k} does not fit a target with {num_layers} layers: "
            f"choose 1..{max(hi, 0)} or set target.layer_ids explicitly."
        )
    if k == 1:
        return [hi]
    return [round(1 + i * (hi - 1) / (k - 1)) for i in range(k)]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
    except KeyError:
        raise ValueError(f"dtype={name!r} is not supported: use auto, bfloat16, float16 or float32.") from None


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # owner/name, or a legacy bare name


def check_model_path(path: str, setting: str) -> str:
    """`path` if it is a model directory or could be a hub repo id; else a ValueError naming `setting`
    (rather than the hub client's "Repo id must be in the form ..." about a path that is not there)."""
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise ValueError(f"{setting}={path!r} is a directory without config.json: point it at a Hugging "
                             "Face model directory (config.json, weights, tokenizer files).")
        return local
    if os.path.exists(local) or not _REPO_ID.match(path):
        raise ValueError(f"{setting}={path!r} is not a model directory (no such directory) nor a hub repo id "
                         "(owner/name): fix the path, or use a builtin such as builtin:tiny-qwen3.")
    return path


def text_config_dict(config: dict) -> dict:
    """The decoder's fields at the top level: a multimodal config.json (Qwen3.5) nests them under
    `text_config`, beside a vision tower the target never runs."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    outer = {k: v for k, v in config.items() if not k.endswith("_config")}
    return {**outer, **text}


def load_target_config(path: str) -> dict:
    """The target decoder's config.json fields as a flat dict (no weights touched)."""
    from transformers import AutoConfig

    return text_config_dict(AutoConfig.from_pretrained(path).to_dict())
