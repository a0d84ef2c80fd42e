"""The frozen target at work: packed rows in, the captured layers out (a HiddenBatch).

"Layer i" is the output of decoder layer i (`hidden_states[i + 1]` of an HF forward). The worker runs
the decoder's own layers in its own loop and returns the captured ones from it as values, so a
compiled forward keeps them whatever the graph looks like (no hook writes to lose at a graph break).
Layers past the last captured one, the final norm (unless the last layer is captured) and the LM
head are dropped at load and never run.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..batch import HiddenBatch, PackedBatch, join_rows
from ..cuda_graph import describe_state
from ..gpu_memory import give_back_cached
from ..reductions import UNTIMED_POINTWISE
from ..triton_launch import shared_memory
from .linear_attn import Spans, describe as describe_linear, documents, install
from .doc_attn import ATTN_NAME as DOC_ATTENTION, doc_rows, register as register_doc_attention, unsupported
from .fold import Fold, fold_layer
from .attention import (FLEX_OUTSIDE_GRAPH, VARLEN_OUTSIDE_GRAPH, block_diagonal_causal_mask, check_varlen,
                        choose_attention, describe_attention, doc_causal_block_mask, fallback_attention,
                        load_attention, register_flex_outside_graph, register_varlen_outside_graph, sliding_window_of,
                        supports_flex)
from .graph import ForwardGraph, unsupported as graph_unsupported
from .weights import causal_lm_class, load_stage, random_init_seed, random_target, stage_memory_error, truncate

log = logging.getLogger(__name__)

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
# The layers' pointwise kernels untimed: the same config in every compile (reductions.UNTIMED_POINTWISE).
COMPILE_OPTIONS = UNTIMED_POINTWISE
# The submodules of a decoder layer laid out as Llama's (Qwen2/3, Mistral, ...): pre-norm attention and
# MLP, each added to the residual stream. Other layouts (Gemma's four norms, linear-attention mixers)
# run as they are.
PLAIN_LAYER = frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"})


class DeferredAdd(nn.Module):
    """Decoder layer laid out as Llama's, run with its last residual add left to the next layer.

    Compiled one layer at a time, a layer ends with `residual + mlp(...)` and the next one starts with
    its input norm of that sum: two kernels over the residual stream, which is written by the first and
    read back by the second. Here a layer takes the previous one's pair (residual, delta) instead,
    adds them as its first op, and returns (that sum, its own residual after attention, its MLP
    output): Inductor fuses the add into the input norm (one pass reads both and writes the sum and
    the normed row), as it does for the add after attention. Eager, these are the layer's own ops on
    the same values in the same order, so the outputs are bit-identical (TargetWorker.check_compiled
    checks that at load); compiled, the norm reads the sum before its bf16 rounding, as Inductor's
    fused add and norm after attention already do (the 8B target's captured layers move by bf16
    noise, BENCHMARKS.md).

    `fused_swiglu`: a `gated_silu` MLP runs its gate and up projections and the SwiGLU as one Triton
    GEMM (swiglu.py). TargetWorker sets it on its compiled layers only: check_compiled then holds the
    kernel to the model's own MLP, run eager."""

    def __init__(self, layer: nn.Module, fused_swiglu: bool = False):
        super().__init__()
        self.layer = layer
        self.mlp_forward = None
        if fused_swiglu:  # imported on request: swiglu.py loads torch._dynamo, which a tool's start need not
            from ..swiglu import gated_silu, mlp_forward

            self.mlp_forward = mlp_forward if gated_silu(layer.mlp) else None

    @property
    def fused_swiglu(self) -> bool:
        return self.mlp_forward is not None

    def forward(self, residual, delta, attention_mask, position_ids, position_embeddings):
        h = residual + delta  # the previous layer's output
        layer = self.layer
        a = layer.self_attn(hidden_states=layer.input_layernorm(h), attention_mask=attention_mask,
                            position_ids=position_ids, position_embeddings=position_embeddings)[0]
        mid = h + a
        x = layer.post_attention_layernorm(mid)
        m = self.mlp_forward(layer.mlp, x) if self.mlp_forward is not None else layer.mlp(x)
        return h, mid, (m[0] if isinstance(m, tuple) else m)


def head_dim_of(config) -> int:
    """The attention head size of a loaded model's (text) config."""
    text = config.get_text_config()
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def triton_or_fallback(config, model_cls: type, dtype: torch.dtype, device: torch.device) -> str:
    """`auto` on CUDA: the Triton kernel where the loaded target's shapes and the GPU suit it, else the
    fallback, logged."""
    why = unsupported(head_dim_of(config), dtype, shared_memory(device))
    if why is None:
        return "triton"
    fallback = fallback_attention(model_cls)
    log.info("target attention: the Triton kernel cannot run this target (%s); using %s", why, fallback)
    return fallback


class TargetWorker:
    """Runs the truncated target over packed batches and returns HiddenBatches.

    `compile`: each decoder layer is compiled on its own (`compile_scope="layers"`): identical layers
    share one graph, so a 64-layer hybrid compiles two graphs (its linear- and its full-attention
    layer), not one graph of 64 layers, which took minutes on a cold node. `compile_scope="forward"`
    compiles the whole forward as one region (for comparison). flex_attention runs as its own compiled
    kernel between the graph pieces (`FLEX_OUTSIDE_GRAPH`) unless `flex_in_graph`; linear-attention
    layers are custom ops inside the graph (linear_attn.py). `varlen` attention (FlashAttention-2's
    varlen kernel) always runs outside the graph (`VARLEN_OUTSIDE_GRAPH`), on the row's document spans
    (`documents`, as linear attention), not a mask: a graph input whose size is the row's document
    count would recompile the layers at every new count.

    `layers` = (first, end): one stage of a staged target (stages.py) runs decoder layers [first, end)
    only. A first stage takes PackedBatches; a later one takes the previous stage's HiddenBatch, whose
    `hidden` is [residual stream, captured so far]. A stage before the last returns [residual stream
    after its layers, captured so far], the last returns the captured layers alone, as one stage does.

    `cross_documents`: linear-attention layers run a packed row as one sequence (a leaking variant,
    for the packing check's tests).

    `cuda_graph`: `forward` replays the forward as a CUDA graph where it can be captured (graph.py;
    `self.graph_why` says why not where it cannot).

    `defer_residual`: compiled layer by layer, layers laid out as Llama's hand the next one their
    (residual, delta) pair and it adds them inside its input norm (DeferredAdd): one pass over the
    residual stream less per layer (BENCHMARKS.md, calls U-Y). Checked at load (check_compiled).

    `compile_options`: Inductor options on top of COMPILE_OPTIONS (bench/target_forward.py's
    `-autotune` variants: the layers' matmuls autotuned against Triton templates).

    `fused_swiglu`: compiled deferred layers run their MLP's gate and up projections and the SwiGLU as
    one Triton GEMM (DeferredAdd; bench/target_forward.py's `-swiglu` variants).

    `fold_norms`: compiled deferred layers get their RMSNorm weights folded into the projections that
    read the norms' outputs (fold.py), so the normed rows are never written; done by check_compiled,
    layer by layer, where a folded layer's output equals its own forward's to rounding (`folded` lists
    them). `fold_layers` folds without that check (bench/target_forward.py's `-fold` variants).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], device: torch.device, compile: bool = False,
                 flex_in_graph: bool = False, layers: tuple[int, int] | None = None, cross_documents: bool = False,
                 compile_scope: str = "layers", cuda_graph: bool = False, defer_residual: bool = True,
                 compile_options: dict | None = None, fused_swiglu: bool = False, fold_norms: bool = False):
        self.all_layer_ids = sorted(layer_ids)
        first, end = layers if layers is not None else (0, max(layer_ids) + 1)
        self.first_stage, self.last_stage = first == 0, end == max(layer_ids) + 1
        self.stage_layers = (first, end)
        self.layer_ids = [i for i in self.all_layer_ids if first <= i < end]  # the ones this stage captures
        self._captures = frozenset(self.layer_ids)
        self.device = device
        self.model = model
        self.decoder = decoder = model.get_decoder()
        missing = [a for a in ("layers", "rotary_emb") + (("embed_tokens",) if self.first_stage else ())
                   if not hasattr(decoder, a)]
        if missing:
            raise ValueError(f"target {type(model).__name__}: its decoder has no {', '.join(missing)}; dflash_mp runs "
                             "decoders laid out as Llama/Qwen (embed_tokens, layers, rotary_emb, norm): use such a target.")
        config = model.config
        self.hidden_size = config.get_text_config().hidden_size
        self.head_dim = head_dim_of(config)
        self.dtype = next(p.dtype for p in decoder.parameters() if p.is_floating_point())
        self.window = sliding_window_of(config)
        attn = config._attn_implementation
        self.flex = attn in ("flex_attention", FLEX_OUTSIDE_GRAPH)
        self.varlen = attn in ("varlen", VARLEN_OUTSIDE_GRAPH)
        self.triton = attn in ("triton", DOC_ATTENTION)
        if self.triton:
            why = unsupported(self.head_dim, self.dtype,
                              shared_memory(torch.device(device)))
            if why:
                raise ValueError(f"target.attn_implementation=triton: the kernel cannot run {type(model).__name__} "
                                 f"({why}): use target.attn_implementation=auto, flex_attention or sdpa.")
            config._attn_implementation = register_doc_attention()
        if self.flex and ((compile and not flex_in_graph) or not supports_flex(type(model))):
            config._attn_implementation = register_flex_outside_graph()
        if self.varlen:
            check_varlen(device, self.dtype, self.window)
            config._attn_implementation = register_varlen_outside_graph()
        named = "flex_attention" if self.flex else "varlen" if self.varlen else "triton" if self.triton else attn
        self.attention = describe_attention(named, type(model), compile)
        types = list(getattr(config, "layer_types", None) or [])
        self.layer_types = [types[i] if i < len(types) else "full_attention" for i in range(len(decoder.layers))]
        odd = sorted(set(self.layer_types[first:end]) - set(LAYER_TYPES))
        if odd:
            raise ValueError(f"target {type(model).__name__}: layer types {odd} are not supported (only "
                             f"{', '.join(LAYER_TYPES)}): use another target.")
        # Serving reads the last layer as `hidden_states[L]`, which HF takes after the final norm.
        self._last = len(decoder.layers) - 1
        norm = getattr(decoder, "norm", None)
        self.final_norm = norm if self._last in self.layer_ids and not isinstance(norm, (nn.Identity, type(None))) else None
        # Linear-attention (recurrent) mixers ignore attention masks: they get the row's document spans.
        self.linear = {i: install(m, cross_documents) for i in range(first, end)
                       if (m := getattr(decoder.layers[i], "linear_attn", None)) is not None}
        self.linear_how = describe_linear(set(self.linear.values()), torch.device(device))
        self.compiled, self.compile_scope = compile, compile_scope
        self.compile_options = {**COMPILE_OPTIONS, **(compile_options or {})}
        self._calls = self._eager_calls = list(decoder.layers)  # what the forward calls, per layer
        self.deferred = False  # the compiled layers are DeferredAdds
        self.fold_norms = False  # check_compiled folds the layers' norms (class docstring)
        self.fused_swiglu = fused_swiglu
        self.folded: list[int] = []  # layers whose norms are folded into their projections
        self.fold_diff = 0.0  # the largest folded layer's difference from its own forward (check_compiled)
        if not compile:
            self._run = self._forward
        elif compile_scope == "layers":
            self.deferred = defer_residual and all({n for n, _ in decoder.layers[i].named_children()} == PLAIN_LAYER
                                                   for i in range(first, end))
            self._compile_layers()
            self._run = self._forward
            # The fused SwiGLU reads the MLP's Linear weights itself: no folded gate/up under it.
            self.fold_norms = fold_norms and self.deferred and not fused_swiglu
        elif compile_scope == "forward":
            self._run = torch.compile(self._forward, dynamic=False, options=self.compile_options)
        else:
            raise ValueError(f"compile_scope={compile_scope!r}: use layers or forward")
        self.graph: ForwardGraph | None = None
        self.graph_why = "target.cuda_graph=false" if not cuda_graph else graph_unsupported(
            torch.device(device), named, bool(self.linear), config, compile_scope)
        if self.graph_why is None:
            self.graph = ForwardGraph(self._graphed, torch.device(device))

    @classmethod
    def load(cls, path: str, layer_ids: list[int], device: torch.device, dtype: torch.dtype,
             attn_implementation: str = "auto", compile: bool = False,
             packing_check: bool = True, layers: tuple[int, int] | None = None,
             probe_len: int = 512, cuda_graph: bool = False, fold_norms: bool = False) -> "TargetWorker":
        """`layers`: the [first, end) decoder layers this rank runs (one stage of a staged target,
        stages.StagePlan); None runs every layer up to the last captured one. Only those layers'
        weights are read (and the embedding on a first stage). The attention implementation is
        chosen for the model's class (attention.choose_attention). A compiled forward is checked
        against the eager one on a row of `probe_len` tokens (the run's row length: no second compile).
        `cuda_graph`: replay the forward as a CUDA graph where it can be captured (graph.py). `fold_norms`:
        the compiled layers' norms folded into their projections where the check allows (class docstring)."""
        last = max(layer_ids)
        first, end = layers if layers is not None else (0, last + 1)
        if not 0 <= first < end <= last + 1:
            raise ValueError(f"stage layers [{first}, {end}) are outside the target's layers 0..{last}")
        if device.type == "cuda":  # before any weight is read: a target too large for its GPU fails at once
            index = device.index if device.index is not None else torch.cuda.current_device()
            why = stage_memory_error(path, first, end, last, dtype, *torch.cuda.mem_get_info(index), f"GPU {index}")
            if why:
                raise ValueError(why)
        model_cls = causal_lm_class(path)
        attn = choose_attention(attn_implementation, device, model_cls)
        seed = random_init_seed(path)
        load_as = load_attention(attn, model_cls)
        if seed is None:
            model = load_stage(path, first, end, keep_norm=end == last + 1, dtype=dtype, attn=load_as)
        else:
            model = random_target(path, seed, device, dtype, load_as, first, end, keep_norm=end == last + 1)
        if attn == "triton" and attn_implementation == "auto":
            attn = triton_or_fallback(model.config, model_cls, dtype, device)
        if attn in ("flex_attention", "varlen", "triton"):
            model.config._attn_implementation = attn  # TargetWorker registers its function where needed
        if getattr(model.config, "output_router_logits", False):
            model.config.output_router_logits = False  # MoE: the router's aux outputs are never used
        truncate(model, last)
        model.to(device).eval().requires_grad_(False)
        worker = cls(model, layer_ids, device, compile=compile and device.type == "cuda", layers=(first, end),
                     cuda_graph=cuda_graph, fold_norms=fold_norms)
        log.info("target %s: attention %s; linear attention: %s; CUDA graph: %s", type(model).__name__,
                 worker.attention, worker.linear_how, worker.describe_graph())
        if worker.compiled:
            worker.check_compiled(probe_len)
        if packing_check:
            worker.check_packing()
        else:
            log.warning("target.packing_check=false: %s is not checked for leaks across packed documents",
                        type(model).__name__)
        give_back_cached(device, "target")  # a random target's fp32 draws, the checks' activations
        return worker

    def _compile_layers(self) -> None:
        first, end = self.stage_layers
        self._calls = [torch.compile(DeferredAdd(m, self.fused_swiglu) if self.deferred else m, dynamic=False,
                                     options=self.compile_options)
                       if first <= i < end else m for i, m in enumerate(self.decoder.layers)]

    # ------------------------------------------------------------------------------------ forward
    def run_layer(self, i: int, h: torch.Tensor, pos: torch.Tensor, rope, masks: dict, compiled: bool = False,
                  deferred: bool | None = None) -> torch.Tensor:
        """Decoder layer i on h [1, T, H] (position ids [1, T], RoPE tables, masks by layer type); eager
        unless `compiled` (probes of other shapes never compile). `deferred`: run it as a DeferredAdd
        handed (h, 0) (default: as the forward runs it)."""
        mask = masks[self.layer_types[i]]
        deferred = self.deferred and compiled if deferred is None else deferred
        if deferred:
            layer = self._calls[i] if compiled else DeferredAdd(self._eager_calls[i])
            _, mid, delta = layer(h, torch.zeros_like(h), mask, pos, rope)
            return mid + delta
        layer = (self._calls if compiled else self._eager_calls)[i]
        out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return out[0] if isinstance(out, tuple) else out

    def embed(self, x: torch.Tensor, pos: torch.Tensor):
        """(h [1, T, H], position ids [1, T], RoPE tables): token ids on a first stage, else the
        residual stream [T, H]."""
        h = (self.decoder.embed_tokens(x) if self.first_stage else x)[None]
        return h, pos[None], self.rope(h, pos[None])

    def rope(self, h: torch.Tensor, pos: torch.Tensor):
        """RoPE tables for position ids [1, T]. Multimodal RoPE (Qwen3.5) takes (temporal, height,
        width) ids, [3, 1, T]: text repeats its own (transformers 5.17 requires the 3, later ones add it)."""
        rotary = self.decoder.rotary_emb
        return rotary(h, pos[None].expand(3, 1, -1) if hasattr(rotary, "mrope_section") else pos)

    def _forward(self, x: torch.Tensor, pos: torch.Tensor, masks: dict, before: torch.Tensor | None = None,
                 eager: bool = False, cat: bool = True) -> torch.Tensor | list[torch.Tensor]:
        """`before`: the captured columns the previous stages sent. Returns what this stage passes on
        (class docstring), or (`cat=False`) its column blocks in order. `eager`: the layers uncompiled
        whatever the scope (check_compiled)."""
        h, pos, rope = self.embed(x, pos)
        captured = []
        first, end = self.stage_layers
        if self.deferred and not eager:
            delta = torch.zeros_like(h)
            for i in range(first, end):
                out, h, delta = self._calls[i](h, delta, masks[self.layer_types[i]], pos, rope)
                if i - 1 in self._captures:  # `out` is layer i - 1's output
                    captured.append(self._output(i - 1, out))
            h = h + delta
            if end - 1 in self._captures:
                captured.append(self._output(end - 1, h))
        else:
            for i in range(first, end):
                h = self.run_layer(i, h, pos, rope, masks, compiled=not eager)
                if i in self._captures:
                    captured.append(self._output(i, h))
        parts = ([] if self.last_stage else [h[0]]) + ([] if before is None else [before]) + captured
        return torch.cat(parts, dim=-1) if cat else parts

    def _output(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Captured layer i from its output h [1, T, H]: after the final norm where i is the model's last."""
        return (h if i != self._last or self.final_norm is None else self.final_norm(h))[0]

    def _graphed(self, x: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor, before: torch.Tensor | None
                 ) -> list[torch.Tensor]:
        """What the CUDA graph captures: the row's ranges and the forward, up to the column blocks
        (concatenated outside it, into a tensor of the caller's own)."""
        return self._forward(x, pos, self.masks(docs), before, cat=False)

    def describe_graph(self) -> str:
        return describe_state(self.graph, self.graph_why, "the forward is replayed as one CUDA graph",
                              "the forwards run launched")

    def masks(self, docs: torch.Tensor) -> dict:
        """The packed-document mask per layer type (linear-attention layers, and all layers under
        varlen attention, take none: they get the row's document spans instead)."""
        if self.triton:
            def build(d, window=None):
                return doc_rows(d, self.head_dim, window)
        else:
            build = doc_causal_block_mask if self.flex else block_diagonal_causal_mask
        present = set(self.layer_types[slice(*self.stage_layers)])
        masks = {t: None for t in LAYER_TYPES}
        if self.varlen:
            return masks
        if "full_attention" in present:
            masks["full_attention"] = build(docs)
        if "sliding_attention" in present:
            masks["sliding_attention"] = build(docs, self.window)
        return masks

    def spans(self, docs: torch.Tensor) -> Spans | None:
        return Spans.of(docs, self.device) if self.linear or self.varlen else None

    def _capture(self, x: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor, docs_host: torch.Tensor,
                 before: torch.Tensor | None = None) -> torch.Tensor:
        if self.graph is not None:  # no linear-attention spans where there is a graph (graph.unsupported)
            return torch.cat(self.graph(x, pos, docs, before), dim=-1)
        with documents(self.spans(docs_host)):
            return self._run(x, pos, self.masks(docs), before)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch | HiddenBatch) -> HiddenBatch:
        """A PackedBatch on a first stage; the previous stage's HiddenBatch on a later one."""
        ids = batch.input_ids.to(self.device, non_blocking=True)
        pos = batch.position_ids.to(self.device, non_blocking=True)
        docs = batch.doc_ids.to(self.device, non_blocking=True)
        if self.first_stage:
            hidden = self._capture(ids, pos, docs, batch.doc_ids)
        else:
            incoming = batch.hidden.to(self.device, non_blocking=True)
            h = self.hidden_size
            before = incoming[:, h:] if incoming.shape[1] > h else None
            hidden = self._capture(incoming[:, :h], pos, docs, batch.doc_ids, before=before)
        return HiddenBatch(
            hidden=hidden,
            input_ids=ids,
            position_ids=pos,
            doc_ids=docs,
            loss_mask=batch.loss_mask.to(self.device, non_blocking=True),
            num_valid_tokens=batch.num_valid_tokens,
        )

    @torch.inference_mode()
    def forward_rows(self, rows: list, width: int = 1) -> list[HiddenBatch]:
        """Several packed rows in one forward (`target.rows_per_forward`, a first stage only): laid end to
        end as one row whose documents stay apart (batch.join_rows), so each row's captured states are
        its own forward's, within the kernels' rounding; the matmuls get rows x T rows each, where one
        row's T = 3072 leaves an 8B target's below the GPU's best. Fewer than `width` rows are made up
        with the last row repeated, so every forward has one shape; one HiddenBatch per row given (a
        repeat's states are dropped). A single row may be a later stage's HiddenBatch."""
        if width == 1 and len(rows) == 1:
            return [self.forward(rows[0])]
        if not self.first_stage:
            raise ValueError("forward_rows takes packed data rows, a first stage's (target.rows_per_forward "
                             "> 1 needs target.stages=1)")
        full = rows + rows[-1:] * (width - len(rows))
        whole = self.forward(join_rows(full))
        out, start = [], 0
        for r in rows:
            end = start + r.seq_len
            out.append(HiddenBatch(hidden=whole.hidden[start:end], input_ids=whole.input_ids[start:end],
                                   position_ids=whole.position_ids[start:end],
                                   doc_ids=r.doc_ids.to(self.device, non_blocking=True),
                                   loss_mask=whole.loss_mask[start:end], num_valid_tokens=r.num_valid_tokens))
            start = end
        return out

    def forward_many(self, rows: list[PackedBatch], per_forward: int) -> list[HiddenBatch]:
        """`rows` through forward_rows `per_forward` at a time (the last forward's made up to that width)."""
        return [hb for i in range(0, len(rows), per_forward)
                for hb in self.forward_rows(rows[i:i + per_forward], per_forward)]

    @torch.inference_mode()
    def check_compiled(self, probe_len: int = 512, seed: int = 0) -> float:
        """The compiled forward against the eager one on one packed row of `probe_len` tokens (the
        first compile happens here); where they differ by more than rounding, run eager, warned.

        Compiled layer by layer, each layer is checked alone: fed the eager forward's input to that
        layer, its compiled output must equal its eager one to rounding (the largest mean relative
        difference per token over the layers is returned). Comparing whole forwards instead lets a
        MoE target's router amplify rounding: measured on an H200 (transformers 5.17, torch 2.11),
        Qwen3.5-35B-A3B's compiled forward gave features 64-68% off the eager ones, while its MoE
        block, router, experts and shared expert compiled alone agreed to 5e-3
        (bench/moe_compile_probe.py): a token whose top-8 of 256 experts changes on a last-bit
        difference takes other experts from then on. A whole-forward compile (`compile_scope=
        "forward"`) is compared whole."""
        from .packing import ProbeRow, per_token_rel, probe_row

        lens = [probe_len // 3, probe_len // 2, probe_len - probe_len // 3 - probe_len // 2]
        x, pos, docs = probe_row(self, lens, torch.Generator().manual_seed(seed))
        x = x.to(self.device)
        if self.compile_scope == "forward":
            pos_d, docs_d = pos.to(self.device), docs.to(self.device)
            got = self._capture(x, pos_d, docs_d, docs)
            with documents(self.spans(docs)):
                want = self._forward(x, pos_d, self.masks(docs_d), eager=True)
            rel = float(per_token_rel(got[None], want[None]).mean())
        else:
            h = (self.decoder.embed_tokens(x) if self.first_stage else x)[None]
            rel = self._check_layers(ProbeRow(self, docs, pos, h), h)
        tol = self._tolerance
        name = type(self.model).__name__
        if not rel <= tol:
            log.warning("target %s: the compiled forward's features differ from the eager ones by %.2e per token "
                        "(mean relative, tolerance %.0e): running the target eager. target.compile=false "
                        "skips the compile and this check.", name, rel, tol)
            self.compiled, self._run, self._calls, self.deferred = False, self._forward, self._eager_calls, False
            # The graph captures `_calls` as they are when it first runs, after this: eager layers now.
        else:
            log.info("target %s: the compiled %s equal%s the eager one%s to %.1e per token (tolerance %.0e)%s", name,
                     *(("forward", "s", "") if self.compile_scope == "forward" else ("layers", "", "s")), rel, tol,
                     "; each layer's last residual add runs in the next one's input norm" if self.deferred else "")
        if self.folded:
            log.info("target %s: the norms of %d layers (%d-%d) folded into their projections, %.1e per "
                     "token from their own forwards", name, len(self.folded), min(self.folded),
                     max(self.folded), self.fold_diff)
        return rel

    @property
    def _tolerance(self) -> float:
        """How far (mean relative per token) a layer's compiled or folded output may be from its own."""
        return 1e-3 if self.dtype == torch.float32 else 0.1

    def _check_layers(self, row, h: torch.Tensor) -> float:
        """check_compiled layer by layer from the probe row's input h: the largest mean relative
        difference per token of a compiled layer from its eager output. With `fold_norms`, each layer is
        folded first and kept folded where its eager output stays within rounding of its own forward's
        (then the folded layer is the reference). Deferred, each layer run eager as a DeferredAdd must
        also give its own forward's output bit for bit (a layer with Llama's submodules but other
        arithmetic, e.g. a scaled residual, does not); where one does not, the layers are compiled as
        they are, warned, and checked again from the start."""
        from .packing import per_token_rel

        rel, h0 = 0.0, h
        for i in range(*self.stage_layers):
            want = row.run(self, i, h)
            fold = fold_layer(self.decoder.layers[i], self.hidden_size) if self.fold_norms else None
            if fold is not None:
                got = row.run(self, i, h)
                diff = float(per_token_rel(got, want).mean())
                if diff <= self._tolerance:
                    self.folded.append(i)
                    self.fold_diff = max(self.fold_diff, diff)
                    want = got
                else:
                    fold.undo()
                    log.warning("target %s: layer %d with its norms folded into its projections differs from "
                                "its own forward by %.2e per token (tolerance %.0e): left unfolded",
                                type(self.model).__name__, i, diff, self._tolerance)
                del fold, got  # the replaced modules and their weights, freed before the next layer's fold
            if self.deferred and not torch.equal(row.run(self, i, h, deferred=True), want):
                log.warning("target %s: layer %d run with its residual add deferred to the next layer differs "
                            "from its own forward; compiling the layers as they are", type(self.model).__name__, i)
                self.deferred = False
                self._compile_layers()
                return self._check_layers(row, h0)
            rel = max(rel, float(per_token_rel(row.run(self, i, h, compiled=True), want).mean()))
            h = want
        return rel

    def fold_layers(self) -> list[Fold]:
        """Fold every layer of the stage whose norms fold (fold.fold_layer) without check_compiled's
        check; `undo()` each Fold returned to put the layers back."""
        folds = [(i, fold_layer(self.decoder.layers[i], self.hidden_size)) for i in range(*self.stage_layers)
                 if i not in self.folded]
        self.folded += [i for i, f in folds if f is not None]
        return [f for _, f in folds if f is not None]

    def check_packing(self, lengths: tuple[int, ...] = (128, 256), seed: int = 0) -> dict[int, float]:
        from .packing import check_packing

        return check_packing(self, lengths, seed)
