"""The frozen target: load a Hugging Face causal LM, capture a few layers, stop after the last one.

The drafter is trained on hidden states of `layer_ids` ("layer i" = output of decoder layer i,
`hidden_states[i + 1]` of an HF forward). Layers past the last captured one, the final norm and the
LM head are dropped from the module after loading, so they can never run (and cost no memory).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from .batch import HiddenBatch, PackedBatch
from .options import resolve_auto

log = logging.getLogger(__name__)

# Marker file of a random-weight target directory (builtin.RANDOM_TARGETS): {"seed": int}, no weight files.
RANDOM_INIT = "random_init.json"


@dataclass
class TargetConfig:
    path: str = "builtin:tiny-qwen3"  # HF hub id or local dir; builtin:* = built locally (dflash_mp.builtin)
    layer_ids: list[int] | None = None  # captured layers; None = num_capture layers spread over 1..L-3
    num_capture: int = 5  # K, used when layer_ids is None
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float16 | float32
    attn_implementation: str = "auto"  # auto (flex_attention on CUDA, sdpa on CPU) | sdpa | flex_attention
    compile: bool = True  # torch.compile the truncated forward on CUDA (ignored on CPU)
    cache_dir: str = ""  # where builtin targets are built once; "" = $DFLASH_MP_CACHE or ~/.cache/dflash_mp


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

    @classmethod
    def from_config(cls, config: dict) -> "TargetSpec":
        heads = config["num_attention_heads"]
        rope_theta, rope_scaling = rope_from_config(config)
        sliding = "sliding_attention" in (config.get("layer_types") or [])
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 40960),
            sliding_window=config.get("sliding_window") if sliding else None,
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


def load_target_config(path: str) -> dict:
    """The target's config.json as a dict (no weights touched)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).to_dict()


def _local_dir(path: str, patterns: list[str]) -> str:
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, allow_patterns=patterns)


def random_init_seed(path: str) -> int | None:
    """The seed of a random-weight target directory, None for a checkpoint with weights."""
    marker = os.path.join(path, RANDOM_INIT)
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        return json.load(f)["seed"]


def random_target_head(config: dict, seed: int, device: torch.device, dtype: torch.dtype,
                       with_head: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Embedding and LM head of a random-weight target, normal(0, initializer_range) from a generator of
    their own: target and drafter ranks on the same device type draw identical tensors from `seed`
    alone (drawn in fp32, so every dtype rounds the same values). The embedding is drawn first, so
    `with_head=False` (the target, which drops its head) gets the same one without drawing the head."""
    shape = (config["vocab_size"], config["hidden_size"])
    std = config.get("initializer_range", 0.02)
    g = torch.Generator(device).manual_seed(seed)

    def draw() -> torch.Tensor:
        return torch.empty(shape, device=device).normal_(0.0, std, generator=g).to(dtype)

    embed = draw()
    return embed, draw() if with_head else None


def load_target_head(path: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the embedding and LM head weights of the target (what a drafter rank needs)."""
    from safetensors import safe_open

    seed = random_init_seed(path)
    if seed is not None:
        return random_target_head(load_target_config(path), seed, device, dtype)
    local = _local_dir(path, ["*.json", "*.safetensors"])
    index = os.path.join(local, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        weight_map = None
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    out = {}
    for name in names:
        if weight_map is not None and name not in weight_map:
            continue
        file = weight_map[name] if weight_map is not None else "model.safetensors"
        with safe_open(os.path.join(local, file), framework="pt", device="cpu") as f:
            if name in f.keys():
                out[name] = f.get_tensor(name)
    if "model.embed_tokens.weight" not in out:
        raise ValueError(f"target.path={path}: no model.embed_tokens.weight in its safetensors files; point "
                         "target.path at a full Hugging Face checkpoint of a decoder LM.")
    embed = out["model.embed_tokens.weight"]
    head = out.get("lm_head.weight", embed)  # tied embeddings
    return embed.to(device, dtype), head.to(device, dtype)


def resolve_attn(name: str, device: torch.device) -> str:
    return resolve_auto("target.attn_implementation", name, device, cuda="flex_attention", cpu="sdpa",
                        allowed=("sdpa", "flex_attention", "eager"))


def doc_causal_block_mask(doc_ids: torch.Tensor, window: int | None = None):
    """flex_attention BlockMask of the packed-document causal mask: no dense [T, T] tensor, and
    blocks outside every document's triangle are skipped by the kernel. `window`: sliding-window
    layers also require q - kv < window (transformers' sliding-window mask)."""
    def mask_mod(b, h, q, kv):
        seen = (doc_ids[q] == doc_ids[kv]) & (kv <= q)
        return seen if window is None else seen & (q - kv < window)

    t = doc_ids.shape[0]
    return _compiled_create_block_mask()(mask_mod, None, None, t, t, device=doc_ids.device)


_CBM = None


def _compiled_create_block_mask():
    global _CBM  # one compiled builder per process, compiled lazily (no CUDA work at import)
    if _CBM is None:
        from torch.nn.attention.flex_attention import create_block_mask

        _CBM = torch.compile(create_block_mask, dynamic=False)
    return _CBM


def block_diagonal_causal_mask(doc_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[1, 1, T, T] bool: token i sees token j iff same document and j <= i (padding sees itself);
    with `window`, also i - j < window."""
    t = doc_ids.shape[0]
    same = doc_ids[:, None] == doc_ids[None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    if window is not None:
        causal = causal.triu(-(window - 1))
    eye = torch.eye(t, dtype=torch.bool, device=doc_ids.device)
    return ((same & causal) | eye)[None, None]


def sliding_window_of(config) -> int | None:
    """The window of the target's sliding-window layers, None if it has none."""
    if "sliding_attention" not in (getattr(config, "layer_types", None) or []):
        return None
    window = getattr(config, "sliding_window", None)
    if not window:
        raise ValueError(f"the target has sliding_attention layers but sliding_window={window!r} in its "
                         "config.json: set sliding_window there (or check target.path).")
    return int(window)


# The name under which `_flex_outside_graph` is registered with transformers' attention functions.
FLEX_OUTSIDE_GRAPH = "dflash_mp_flex"


def _flex_outside_graph(module, query, key, value, attention_mask, **kwargs):
    """transformers' flex_attention forward, run outside the compiled target graph.

    Traced into the graph, Inductor fuses each layer's q/k RMSNorm and RoPE into the flex_attention
    kernel as a prologue that every (query tile, key tile) pair recomputes: 15.2 ms per Qwen3-8B
    batch (T = 3072) against 6.4 ms for the same attention compiled on its own (BENCHMARKS.md).
    Dynamo breaks the graph here; the norm/RoPE before and the projections after stay compiled.
    """
    from transformers.integrations.flex_attention import flex_attention_forward

    return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_flex_outside_graph() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX_OUTSIDE_GRAPH, torch.compiler.disable(_flex_outside_graph))
    return FLEX_OUTSIDE_GRAPH


class TargetWorker:
    """Runs the truncated target over packed batches and returns HiddenBatches.

    `compile`: the forward is one `torch.compile` region, except flex_attention itself, which runs as
    its own compiled kernel between the graph pieces (`_flex_outside_graph`) unless `flex_in_graph`.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], device: torch.device, compile: bool = False,
                 flex_in_graph: bool = False):
        self.layer_ids = list(layer_ids)
        self.device = device
        self.model = model
        self.decoder = model.get_decoder()
        self.flex = model.config._attn_implementation in ("flex_attention", FLEX_OUTSIDE_GRAPH)
        self.window = sliding_window_of(model.config)
        if compile and self.flex and not flex_in_graph:
            model.config._attn_implementation = _register_flex_outside_graph()
        self._captured: dict[int, torch.Tensor] = {}
        for i in self.layer_ids:
            self.decoder.layers[i].register_forward_hook(self._hook(i))
        self._run = torch.compile(self._forward, dynamic=False) if compile else self._forward

    def _hook(self, i: int):
        def hook(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    @classmethod
    def load(cls, path: str, layer_ids: list[int], device: torch.device, dtype: torch.dtype,
             attn_implementation: str = "auto", compile: bool = False) -> "TargetWorker":
        from transformers import AutoModelForCausalLM

        attn = resolve_attn(attn_implementation, device)
        seed = random_init_seed(path)
        if seed is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
        else:
            model = random_target(path, seed, device, dtype, attn)
        truncate(model, max(layer_ids))
        model.to(device).eval().requires_grad_(False)
        return cls(model, layer_ids, device, compile=compile and device.type == "cuda")

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask) -> torch.Tensor:
        self.decoder(input_ids=ids[None], position_ids=pos[None], attention_mask=mask, use_cache=False)
        hidden = torch.cat([self._captured[i][0] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return hidden

    def masks(self, docs: torch.Tensor):
        """The packed-document mask; for targets with sliding-window layers, one per layer type (a
        mask passed as is would give sliding layers the whole document)."""
        build = doc_causal_block_mask if self.flex else block_diagonal_causal_mask
        full = build(docs)
        if self.window is None:
            return full
        return {"full_attention": full, "sliding_attention": build(docs, self.window)}

    @torch.inference_mode()
    def forward(self, batch: PackedBatch) -> HiddenBatch:
        ids = batch.input_ids.to(self.device, non_blocking=True)
        pos = batch.position_ids.to(self.device, non_blocking=True)
        docs = batch.doc_ids.to(self.device, non_blocking=True)
        mask = self.masks(docs)
        hidden = self._run(ids, pos, mask)
        return HiddenBatch(
            hidden=hidden,
            input_ids=ids,
            position_ids=pos,
            doc_ids=docs,
            loss_mask=batch.loss_mask.to(self.device, non_blocking=True),
            num_valid_tokens=batch.num_valid_tokens,
        )


def random_target(path: str, seed: int, device: torch.device, dtype: torch.dtype, attn: str) -> nn.Module:
    """The model of a random-weight target, initialised on `device` (8B: seconds on a GPU, where a CPU
    init takes minutes), seeded without touching the caller's RNG. Its embedding is the one
    `load_target_head` gives drafter ranks; its LM head is dropped by `truncate`, so it is left as drawn."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    embed, _ = random_target_head(config.to_dict(), seed, device, dtype, with_head=False)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(embed)
    return model


def truncate(model: nn.Module, last_layer: int) -> None:
    """Drop decoder layers after `last_layer`, the final norm and the LM head."""
    decoder = model.get_decoder()
    decoder.layers = decoder.layers[: last_layer + 1]
    decoder.norm = nn.Identity()
    model.lm_head = nn.Identity()
    model.config.num_hidden_layers = last_layer + 1
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[: last_layer + 1]
