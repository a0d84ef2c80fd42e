"""Target weights: a checkpoint's or a random-weight target's, one stage's layers only (the others are
never read), truncated after the last captured layer; and the embedding and LM head drafter ranks need."""

from __future__ import annotations

import copy
import json
import math
import os

import torch
from torch import nn

from .spec import load_target_config

# Marker file of a random-weight target directory (builtin.RANDOM_TARGETS): {"seed": int}, no weight files.
RANDOM_INIT = "random_init.json"


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
    `with_head=False` (the target, which drops its head) gets the same one without drawing the head.
    A config with tied embeddings gets one tensor for both, as `load_target_head` gives for a checkpoint."""
    shape = (config["vocab_size"], config["hidden_size"])
    std = config.get("initializer_range", 0.02)
    g = torch.Generator(device).manual_seed(seed)

    def draw() -> torch.Tensor:
        return torch.empty(shape, device=device).normal_(0.0, std, generator=g).to(dtype)

    embed = draw()
    if not with_head:
        return embed, None
    return embed, embed if config.get("tie_word_embeddings") else draw()


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
    # Multimodal checkpoints (Qwen3.5) keep the decoder under model.language_model.
    names = ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "lm_head.weight"]
    out = {}
    for name in names:
        if weight_map is not None and name not in weight_map:
            continue
        file = weight_map[name] if weight_map is not None else "model.safetensors"
        with safe_open(os.path.join(local, file), framework="pt", device="cpu") as f:
            if name in f.keys():
                out[name] = f.get_tensor(name)
    embed = out.get("model.embed_tokens.weight", out.get("model.language_model.embed_tokens.weight"))
    if embed is None:
        raise ValueError(f"target.path={path}: no model.embed_tokens.weight (nor model.language_model."
                         "embed_tokens.weight) in its safetensors files; point target.path at a full Hugging "
                         "Face checkpoint of a decoder LM.")
    embed_here = embed.to(device, dtype)
    if "lm_head.weight" not in out:  # tied embeddings: one tensor for both, not copied twice
        return embed_here, embed_here
    return embed_here, out["lm_head.weight"].to(device, dtype)


class Elsewhere(nn.Module):
    """Stands in for a decoder layer (or the embedding) that another stage of a staged target runs:
    no weights, and the residual stream passes through. It keeps the layer's type, which decoders read."""

    def __init__(self, layer_type: str | None = None):
        super().__init__()
        if layer_type is not None:
            self.layer_type = self.attention_type = layer_type

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def strip_to_stage(model: nn.Module, first: int, end: int, keep_norm: bool) -> None:
    """Keep decoder layers [first, end) of `model`: the others become `Elsewhere`, as does the
    embedding of a stage after the first; the LM head goes, and the final norm unless `keep_norm`
    (the stage that runs the last captured layer keeps it: TargetWorker applies it to the last layer).
    Layer indices stay global, so checkpoint names and `config.layer_types[i]` still match."""
    decoder = model.get_decoder()
    types = list(getattr(decoder.config, "layer_types", None) or [])
    others = [i for i in range(len(decoder.layers)) if not first <= i < end]
    for i in others:
        decoder.layers[i] = Elsewhere(types[i] if i < len(types) else None)
    # The checkpoint's weights of what is dropped here are expected to go unread: no load report on them.
    skipped = [r"(^|\.)lm_head\."]
    if others:
        skipped.append(rf"(^|\.)layers\.({'|'.join(map(str, others))})\.")
    if first > 0:
        decoder.embed_tokens = Elsewhere()
        skipped.append(r"(^|\.)embed_tokens\.")
    if not keep_norm:
        decoder.norm = nn.Identity()
        skipped.append(r"(^|\.)norm\.weight$")
    model.lm_head = nn.Identity()
    if hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = {}
    model._keys_to_ignore_on_load_unexpected = {*(model._keys_to_ignore_on_load_unexpected or ()), *skipped}


def _untied(config):
    """`config` (and its text config) without tied embeddings: a stage holds no LM head to tie."""
    config.tie_word_embeddings = False
    config.get_text_config().tie_word_embeddings = False
    return config


def causal_lm_class(path: str | None, config=None) -> type:
    """The transformers class AutoModelForCausalLM builds for the checkpoint at `path` (its config
    only, read unless `config` is given: the class decides the attention implementations transformers
    allows)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = config if config is not None else AutoConfig.from_pretrained(path)
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def _stage_class(source, first: int, end: int, keep_norm: bool):
    """(config, class) of the model load_stage builds: the checkpoint's causal LM class, which keeps
    decoder layers [first, end) only (`strip_to_stage`). `source`: the checkpoint's path, or its
    transformers config (a copy is changed)."""
    from transformers import AutoConfig

    config = _untied(AutoConfig.from_pretrained(source) if isinstance(source, str) else copy.deepcopy(source))
    base = causal_lm_class(None, config)
    text = (getattr(config, "sub_configs", None) or {}).get("text_config")
    if text is not None and getattr(base, "config_class", None) is text:
        config = config.get_text_config()  # a multimodal checkpoint's decoder class takes the text config, as Auto

    class Stage(base):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            strip_to_stage(self, first, end, keep_norm)

    # The loader looks weight conversions up by class name and applies them to library classes only:
    # the stage passes for the model's own class.
    Stage.__name__, Stage.__qualname__, Stage.__module__ = base.__name__, base.__qualname__, base.__module__
    return config, Stage


def load_stage(path: str, first: int, end: int, keep_norm: bool, dtype: torch.dtype, attn: str) -> nn.Module:
    """The target checkpoint at `path` with decoder layers [first, end) only (`strip_to_stage`): the
    model is built without weights, the layers of other stages are dropped before loading, so their
    weights (and the LM head's) are never read. transformers' own loader reads the rest, shards and
    weight conversions (fused MoE experts) included."""
    config, stage = _stage_class(path, first, end, keep_norm)
    return stage.from_pretrained(path, config=config, dtype=dtype, attn_implementation=attn)


def stage_weight_bytes(source, first: int, end: int, keep_norm: bool, dtype: torch.dtype) -> int:
    """Bytes of the weights a target rank holds for decoder layers [first, end) of the target at `source`
    (a checkpoint's path, a random-weight target's, or a transformers config: the same modules) in
    `dtype`, the embedding on a first stage included: its model built on the meta device, which
    allocates nothing and reads no weight file, so it is exact for every architecture transformers
    builds (a fraction of a second for 27-235B configs once the model's module is imported, which the
    load does anyway)."""
    config, stage = _stage_class(source, first, end, keep_norm)
    with torch.device("meta"):
        model = stage(config)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def stage_memory_error(path: str, first: int, end: int, last: int, dtype: torch.dtype, free: int, total: int,
                       gpu: str) -> str | None:
    """Why a target rank cannot hold decoder layers [first, end) of the target at `path` (truncated after
    layer `last`) on a GPU with `free` of `total` bytes free (None: its weights fit there). Asked before
    any weight is read: a target too large for its GPU fails in a second with the fix named, instead of
    after minutes of reading the checkpoint into host memory."""
    need = stage_weight_bytes(path, first, end, end == last + 1, dtype)
    if need <= free:
        return None
    whole = need if (first, end) == (0, last + 1) else stage_weight_bytes(path, 0, last + 1, True, dtype)
    gib = 2 ** 30
    head = (f"the target's layers {first}-{end - 1} hold {need / gib:.1f} GiB of {str(dtype).removeprefix('torch.')} "
            f"weights and {gpu} has {free / gib:.1f} GiB free of {total / gib:.1f}")
    stages = math.ceil(whole / (0.9 * total))  # weights at 90% of each GPU: activations need room too
    if stages <= 1:  # it fits such a GPU alone: other processes hold the rest
        return (f"{head}; other processes on it hold {(total - free) / gib:.1f} GiB (a GPU shared with a drafter "
                "holds both models): give the target a GPU of its own, or use GPUs with more memory.")
    return (f"{head}. The target's layers 0-{last} hold {whole / gib:.1f} GiB: split them over at least {stages} "
            f"GPUs with target.stages={stages} (each stage holds only its layers), or use GPUs with more memory.")


def random_target(path: str, seed: int, device: torch.device, dtype: torch.dtype, attn: str,
                  first: int = 0, end: int | None = None, keep_norm: bool = True, keep_head: bool = False) -> nn.Module:
    """The model of a random-weight target, layers [first, end) only, initialised on `device` (8B:
    seconds on a GPU, where a CPU init takes minutes), seeded without touching the caller's RNG.

    Layer i is drawn from seed + 1 + i alone, so every split into stages holds the very same layers;
    the embedding is the one `load_target_head` gives drafter ranks. The other layers are never built:
    the shell (embedding, norm, rotary tables) is a one-layer model of the same config."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path).get_text_config()
    head_config = config.to_dict()  # tied or not: the head drafter ranks draw
    config = _untied(config)
    n = config.num_hidden_layers
    end = n if end is None else end
    types = list(getattr(config, "layer_types", None) or [])
    shell = copy.deepcopy(config)
    shell.num_hidden_layers = 1
    if types:
        shell.layer_types = types[:1]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(shell, dtype=dtype, attn_implementation=attn)
    model.config.num_hidden_layers = n
    if types:
        model.config.layer_types = types
    decoder = model.get_decoder()
    layer_cls = type(decoder.layers[0])
    # Before the layers come, what the model does not keep goes (the shell's layer; a stage's head, a later
    # stage's embedding) and the embedding's fp32 draw is done: the load's peak is then its weights and one
    # layer in fp32.
    decoder.layers = nn.ModuleList()
    if not keep_head:
        strip_to_stage(model, first, end, keep_norm)
    if first == 0:
        embed, head = random_target_head(head_config, seed, device, dtype, with_head=keep_head)
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(embed)
            if keep_head:  # the whole model, for the tools that generate: the head drafters train against
                model.get_output_embeddings().weight.copy_(head)
        del embed, head
    layers = []
    for i in range(n):
        if not first <= i < end:
            layers.append(Elsewhere(types[i] if types else None))
            continue
        with torch.random.fork_rng(devices=devices), torch.device(device), torch.no_grad():
            torch.manual_seed(seed + 1 + i)
            layer = layer_cls(model.config, i)
            for m in layer.modules():  # the model's own init (torch's leaves some tensors empty)
                model._init_weights(m)
        layers.append(layer.to(dtype))
    decoder.layers = nn.ModuleList(layers)
    return model


def load_causal_lm(path: str, device: torch.device, dtype: torch.dtype, attn: str = "sdpa") -> nn.Module:
    """The whole target as a causal LM with its head (regenerate, evaluate: they generate): a
    checkpoint's weights, or a random-weight target's, drawn as the training job draws them (same
    layers as TargetWorker.load, same embedding and head as load_target_head). Eval mode, frozen."""
    check_linear_attention_device(load_target_config(path), device)  # before the weights load (minutes, large)
    seed = random_init_seed(path)
    if seed is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    else:
        model = random_target(path, seed, device, dtype, attn, keep_head=True)
    return model.to(device).eval().requires_grad_(False)


def check_linear_attention_device(config: dict, device: torch.device | str) -> None:
    """Refuse to run a target's own transformers forward on `device` where transformers would send its
    linear-attention layers (`config`'s layer_types; Qwen3.5's Gated DeltaNet) to fla-core's kernels, which
    are GPU-only: transformers up to 5.24 calls fla-core whenever it is installed, whatever the tensors'
    device (5.25 checks the device first). TargetWorker runs its own linear-attention ops and needs no such
    check."""
    if torch.device(device).type == "cuda" or "linear_attention" not in (config.get("layer_types") or []):
        return
    import transformers
    from transformers.integrations import hub_kernels

    from .linear_attn import fla_available

    if "fla" in getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {}) or not fla_available():
        return
    raise ValueError(f"{config.get('model_type', 'the target')} has linear-attention layers, and transformers "
                     f"{transformers.__version__} runs them through fla-core's GPU kernels even on {device}, where "
                     "they fail: run this on CUDA, upgrade transformers (pip install 'transformers>=5.25', which "
                     "keeps CPU tensors on its PyTorch path), or uninstall fla-core (pip uninstall fla-core) "
                     "for CPU runs")


def truncate(model: nn.Module, last_layer: int) -> None:
    """Drop decoder layers after `last_layer`, the final norm (kept when `last_layer` is the last
    layer: TargetWorker applies it to that layer, as serving does) and the LM head."""
    decoder = model.get_decoder()
    if last_layer < len(decoder.layers) - 1:
        decoder.norm = nn.Identity()
    decoder.layers = decoder.layers[: last_layer + 1]
    model.lm_head = nn.Identity()
    model.config.num_hidden_layers = last_layer + 1
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[: last_layer + 1]
