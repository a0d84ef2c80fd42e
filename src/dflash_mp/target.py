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
    packing_check: bool = True  # at load, refuse a target whose packed rows leak across documents
    # Ranks per target replica: >1 splits the target's layers over that many consecutive ranks of one
    # node (a target larger than one GPU), balanced by forward cost; see stages.py.
    stages: int = 1


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
            intermediate_size=config.get("intermediate_size") or 0,  # 0: a MoE config with no dense MLP width
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

    `layers` = (first, end): one stage of a staged target (stages.py) runs decoder layers [first, end)
    only. A first stage takes PackedBatches; a later one takes the previous stage's HiddenBatch, whose
    `hidden` is [residual stream, captured so far]. A stage before the last returns [residual stream
    after its layers, captured so far], the last returns the captured layers alone, as one stage does.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], device: torch.device, compile: bool = False,
                 flex_in_graph: bool = False, layers: tuple[int, int] | None = None):
        self.all_layer_ids = sorted(layer_ids)
        first, end = layers if layers is not None else (0, max(layer_ids) + 1)
        self.first_stage, self.last_stage = first == 0, end == max(layer_ids) + 1
        self.stage_layers = (first, end)
        self.layer_ids = [i for i in self.all_layer_ids if first <= i < end]  # the ones this stage captures
        self.device = device
        self.model = model
        self.decoder = model.get_decoder()
        self.hidden_size = model.config.get_text_config().hidden_size
        self.flex = model.config._attn_implementation in ("flex_attention", FLEX_OUTSIDE_GRAPH)
        self.window = sliding_window_of(model.config)
        self.layer_types = sorted(set(getattr(model.config, "layer_types", None) or []))
        if compile and self.flex and not flex_in_graph:
            model.config._attn_implementation = _register_flex_outside_graph()
        # Serving reads the last layer as `hidden_states[L]`, which HF takes after the final norm.
        last = len(self.decoder.layers) - 1
        norm = getattr(self.decoder, "norm", None)
        self.final_norm = norm if last in self.layer_ids and not isinstance(norm, (nn.Identity, type(None))) else None
        self._captured: dict[int, torch.Tensor] = {}
        for i in self.layer_ids:
            self.decoder.layers[i].register_forward_hook(self._hook(i, self.final_norm if i == last else None))
        # Linear-attention (recurrent) mixers ignore attention masks: they see document boundaries
        # only by being run on one document at a time (`_bounds`, set per batch).
        self._bounds: list[int] | None = None
        self.recurrent = [m for layer in self.decoder.layers if (m := getattr(layer, "linear_attn", None)) is not None]
        for m in self.recurrent:
            m.forward = self._per_document(m.forward)
        self._run = torch.compile(self._forward, dynamic=False) if compile else self._forward

    def _per_document(self, forward):
        # Outside any compiled graph: the split points are data, known only per batch.
        @torch.compiler.disable
        def run(hidden_states, *args, **kwargs):
            b = self._bounds
            if b is None or len(b) <= 2:
                return forward(hidden_states, *args, **kwargs)
            return torch.cat([forward(hidden_states[:, s:e], *args, **kwargs) for s, e in zip(b[:-1], b[1:])],
                             dim=1)

        return run

    def _hook(self, i: int, norm: nn.Module | None):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self._captured[i] = out if norm is None else norm(out)

        return hook

    @classmethod
    def load(cls, path: str, layer_ids: list[int], device: torch.device, dtype: torch.dtype,
             attn_implementation: str = "auto", compile: bool = False,
             packing_check: bool = True, layers: tuple[int, int] | None = None) -> "TargetWorker":
        """`layers`: the [first, end) decoder layers this rank runs (one stage of a staged target,
        stages.StagePlan); None runs every layer up to the last captured one. Only those layers'
        weights are read (and the embedding on a first stage)."""
        attn = resolve_attn(attn_implementation, device)
        last = max(layer_ids)
        first, end = layers if layers is not None else (0, last + 1)
        if not 0 <= first < end <= last + 1:
            raise ValueError(f"stage layers [{first}, {end}) are outside the target's layers 0..{last}")
        seed = random_init_seed(path)
        if seed is None:
            model = load_stage(path, first, end, keep_norm=end == last + 1, dtype=dtype, attn=attn)
        else:
            model = random_target(path, seed, device, dtype, attn, first, end, keep_norm=end == last + 1)
        if getattr(model.config, "output_router_logits", False):
            model.config.output_router_logits = False  # MoE: the router's aux outputs are never used
        truncate(model, last)
        model.to(device).eval().requires_grad_(False)
        worker = cls(model, layer_ids, device, compile=compile and device.type == "cuda", layers=(first, end))
        if packing_check:
            worker.check_packing()
        else:
            log.warning("target.packing_check=false: %s is not checked for leaks across packed documents",
                        type(model).__name__)
        return worker

    def _forward(self, x: torch.Tensor, pos: torch.Tensor, mask, before: torch.Tensor | None = None) -> torch.Tensor:
        """`x`: token ids on a first stage, else the residual stream [T, H]; `before`: the captured
        columns the previous stages sent. Returns what this stage passes on (class docstring)."""
        inputs = {"input_ids": x[None]} if self.first_stage else {"inputs_embeds": x[None]}
        out = self.decoder(**inputs, position_ids=pos[None], attention_mask=mask, use_cache=False)
        parts = [] if self.last_stage else [out.last_hidden_state[0]]
        if before is not None:
            parts.append(before)
        parts += [self._captured[i][0] for i in self.layer_ids]
        self._captured.clear()
        return torch.cat(parts, dim=-1)

    def masks(self, docs: torch.Tensor):
        """The packed-document mask; for targets with several layer types, one per type (a mask passed
        as is would give sliding layers the whole document; linear-attention layers take none, they
        are split per document instead)."""
        build = doc_causal_block_mask if self.flex else block_diagonal_causal_mask
        full = build(docs)
        if self.window is None and self.layer_types in ([], ["full_attention"]):
            return full
        masks = {t: None for t in self.layer_types}
        masks["full_attention"] = full
        if self.window is not None:
            masks["sliding_attention"] = build(docs, self.window)
        return masks

    def _capture(self, x: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor, run=None,
                 before: torch.Tensor | None = None) -> torch.Tensor:
        if self.recurrent:
            cuts = (torch.nonzero(docs[1:] != docs[:-1]).flatten() + 1).tolist()
            self._bounds = [0, *cuts, docs.shape[0]]
        try:
            return (run or self._run)(x, pos, self.masks(docs), before)
        finally:
            self._bounds = None

    @torch.inference_mode()
    def forward(self, batch: PackedBatch | HiddenBatch) -> HiddenBatch:
        """A PackedBatch on a first stage; the previous stage's HiddenBatch on a later one."""
        ids = batch.input_ids.to(self.device, non_blocking=True)
        pos = batch.position_ids.to(self.device, non_blocking=True)
        docs = batch.doc_ids.to(self.device, non_blocking=True)
        if self.first_stage:
            hidden = self._capture(ids, pos, docs)
        else:
            incoming = batch.hidden.to(self.device, non_blocking=True)
            h = self.hidden_size
            before = incoming[:, h:] if incoming.shape[1] > h else None
            hidden = self._capture(incoming[:, :h], pos, docs, before=before)
        return HiddenBatch(
            hidden=hidden,
            input_ids=ids,
            position_ids=pos,
            doc_ids=docs,
            loss_mask=batch.loss_mask.to(self.device, non_blocking=True),
            num_valid_tokens=batch.num_valid_tokens,
        )

    @torch.inference_mode()
    def check_packing(self, lengths: tuple[int, ...] = (128, 256), seed: int = 0) -> dict[int, float]:
        """Run a probe of documents packed into one row and each document alone; raise a ValueError
        naming the target class and the first captured layer whose packed features differ beyond
        rounding (a layer that sees across document boundaries would train the drafter on features
        serving never produces). Returns {layer: relative difference}. Eager, so a compiled target
        compiles no probe shapes. A stage after the first probes its own layers with a random
        residual stream (its input is another stage's output); a stage before the last also checks
        the residual stream it passes on (keyed by its last layer when that one is not captured)."""
        width = self.hidden_size
        g = torch.Generator().manual_seed(seed)
        dtype = next(p.dtype for p in self.decoder.parameters() if p.is_floating_point())
        if self.first_stage:
            vocab = self.model.get_input_embeddings().weight.shape[0]
            inputs = [torch.randint(vocab, (n,), generator=g).to(self.device) for n in lengths]
        else:
            inputs = [torch.randn(n, width, generator=g).to(self.device, dtype) for n in lengths]
        positions = [torch.arange(n, device=self.device) for n in lengths]
        doc_ids = torch.cat([torch.full((n,), d, device=self.device) for d, n in enumerate(lengths)])
        packed = self._capture(torch.cat(inputs), torch.cat(positions), doc_ids, run=self._forward)
        alone = torch.cat([self._capture(x, pos, torch.zeros_like(pos), run=self._forward)
                           for x, pos in zip(inputs, positions)])
        # Column blocks of the output: the residual stream (a stage before the last), then its captures.
        ends = [] if self.last_stage else [f"residual after layer {self.stage_layers[1] - 1}"]
        blocks = ends + self.layer_ids
        floor = 1e-3 if dtype == torch.float32 else 3e-2
        first = lengths[0]
        diffs, tols = {}, {}
        for k, layer in enumerate(blocks):
            cols = slice(k * width, (k + 1) * width)
            # Per token: a leak is largest at a document's first tokens (nothing of their own to
            # attend to yet) and must not be averaged away over the rest of the row.
            p, a = packed[:, cols].float(), alone[:, cols].float()
            rel = (p - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12)
            # The first document has nothing before it to leak from: its difference is the kernels'
            # rounding at another row length (bf16 on a GPU), the scale a leak must stand out from;
            # but only while small: a first document that moves by more than NOISE_CAP sees what
            # follows it, a leak of its own.
            noise = float(rel[:first].max())
            diffs[layer] = max(float(rel[first:].max()), noise)
            tols[layer] = max(floor, 4 * noise) if noise <= NOISE_CAP else floor
        tol = max(tols.values())
        bad = [layer for layer, d in diffs.items() if not d <= tols[layer]]
        if bad:
            layer = bad[0]
            what = layer if isinstance(layer, str) else f"captured layer {layer}"
            raise ValueError(
                f"target {type(self.model).__name__}: {what} differs by {diffs[layer]:.2e} "
                f"(relative, tolerance {tols[layer]:.2e}) between a packed row of {len(lengths)} documents and each "
                "document run alone, so some layer sees across document boundaries and the drafter would "
                "train on leaked features. Use a target whose layers honour the packed-document mask (or "
                "run it with another target.attn_implementation); target.packing_check=false skips this "
                "check at the cost of those leaked features.")
        log.info("target %s packs exactly: max relative difference %.1e (tolerance %.1e) over layers %s",
                 type(self.model).__name__, max(diffs.values()), tol, blocks)
        return diffs


NOISE_CAP = 0.05  # the most rounding the packing check attributes to kernels (bf16, another row length)


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


def load_stage(path: str, first: int, end: int, keep_norm: bool, dtype: torch.dtype, attn: str) -> nn.Module:
    """The target checkpoint at `path` with decoder layers [first, end) only (`strip_to_stage`): the
    model is built without weights, the layers of other stages are dropped before loading, so their
    weights (and the LM head's) are never read. transformers' own loader reads the rest, shards and
    weight conversions (fused MoE experts) included."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = _untied(AutoConfig.from_pretrained(path))
    base = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    text = (getattr(config, "sub_configs", None) or {}).get("text_config")
    if text is not None and getattr(base, "config_class", None) is text:
        config = config.get_text_config()  # a multimodal checkpoint's decoder class takes the text config (as Auto does)

    class Stage(base):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            strip_to_stage(self, first, end, keep_norm)

    # The loader looks weight conversions up by class name and applies them to library classes only:
    # the stage passes for the model's own class.
    Stage.__name__, Stage.__qualname__, Stage.__module__ = base.__name__, base.__qualname__, base.__module__
    return Stage.from_pretrained(path, config=config, dtype=dtype, attn_implementation=attn)


def random_target(path: str, seed: int, device: torch.device, dtype: torch.dtype, attn: str,
                  first: int = 0, end: int | None = None, keep_norm: bool = True) -> nn.Module:
    """The model of a random-weight target, layers [first, end) only, initialised on `device` (8B:
    seconds on a GPU, where a CPU init takes minutes), seeded without touching the caller's RNG.

    Layer i is drawn from seed + 1 + i alone, so every split into stages holds the very same layers;
    the embedding is the one `load_target_head` gives drafter ranks. The other layers are never built:
    the shell (embedding, norm, rotary tables) is a one-layer model of the same config."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    config = _untied(AutoConfig.from_pretrained(path).get_text_config())
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
    if first == 0:
        embed, _ = random_target_head(config.to_dict(), seed, device, dtype, with_head=False)
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(embed)
    strip_to_stage(model, first, end, keep_norm)
    return model


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
