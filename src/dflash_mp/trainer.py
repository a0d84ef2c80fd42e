"""Drafter-side training: the objective (one compiled forward + loss) and the trainer loop body.

`DFlashObjective` is everything from a received HiddenBatch to the weighted CE: anchor sampling on
device, block construction, the drafter forward, the chunked fused CE. It is one module so that
`torch.compile` sees one fixed-shape graph. `DrafterTrainer` adds backward, the data-parallel
gradient all-reduce, clipping, AdamW with warm-up + cosine, and on-device metric accumulation;
the host synchronises only at the logging interval.
"""

from __future__ import annotations

import logging
import math
import time
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .batch import HiddenBatch
from .cuda_graph import describe_state
from .gpu_memory import give_back_cached
from .model import (
    DFlashDrafter,
    DrafterArgs,
    block_labels,
    build_blocks,
    dflash_loss,
    sample_anchors,
    slot_weights,
)
from .model.attention import FLEX_KERNEL_OPTIONS
from .model import ce_kernels
from .model.loss import LOSS_KERNELS
from .optim import FlatAdamW, replicas
from .options import resolve_auto
from .step_graph import CAPTURE_AT, StepGraph, unsupported as graph_unsupported
from .target import TargetSpec

log = logging.getLogger(__name__)


@dataclass
class DrafterConfig:
    num_layers: int = 1  # drafter decoder layers (N)
    block_size: int = 16  # B: anchor token + B-1 mask slots
    mask_token_id: int | None = None  # None = first embedding row past the tokenizer (must exist)
    intermediate_size: int | None = None  # None = the target's
    num_heads: int | None = None  # None = the target's
    num_kv_heads: int | None = None  # None = the target's
    head_dim: int | None = None  # None = the target's
    layer_types: list[str] | None = None  # per layer full_attention | sliding_attention; None = all full
    sliding_window: int | None = None  # W for sliding layers
    num_anchors: int = 512  # A: blocks per packed batch (fixed; unused slots masked out of the loss)
    max_anchors_per_doc: int = 512  # cap of anchors drawn from one document
    gamma: float | None = None  # loss decay exp(-(k-1)/gamma); None = 7/5/4 for B=16/10/8
    loss_chunk_size: int = 2048  # rows of logits computed at once (never the full A*B x vocab)
    attention: str = "auto"  # auto (triton on CUDA where the shapes allow, else flex; dense sdpa on CPU) |
    #   triton (model/block_attn.py: kernels that walk only the keys each block sees) | flex | dense
    flex_block_size: tuple[int, int] = (128, 128)  # flex BlockMask tile (query rows, key rows)
    flex_kernel_options: dict = field(default_factory=lambda: dict(FLEX_KERNEL_OPTIONS))  # flex_attention
    #   kernel options (tiles: fwd_BLOCK_M, bwd_BLOCK_M1, ...; they must divide flex_block_size); the
    #   default is tuned for 16-query blocks on the H200, {} = Inductor's own choice


@dataclass
class TrainConfig:
    max_steps: int = 0  # drafter optimizer steps; 0 = derive from epochs
    epochs: float = 1.0  # passes over the data when max_steps is 0
    lr: float = 6e-4  # peak learning rate
    warmup_ratio: float = 0.04  # fraction of steps with linear warm-up
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    seed: int = 0  # init, anchors and data order
    compile: str = "auto"  # auto (default on CUDA, eager on CPU) | eager | default | reduce-overhead
    compile_scope: str = "layers"  # layers: each decoder layer (and each RMSNorm outside them) on its
    #   own (identical layers share one graph: kernels compile once, in minutes, not per layer) |
    #   step: the whole objective is one graph
    loss_kernel: str = "auto"  # the fused CE's passes over each chunk of logits: auto (triton on CUDA
    #   in compiled modes, layers scope; else eager) | triton | inductor (a torch.compile'd chunk) |
    #   eager. In step scope the chunk is part of the one graph and this is ignored.
    optimizer_overlap: bool = True  # CUDA, layers scope or eager, not reduce-overhead: each layer's
    #   AdamW update runs on a side stream while the next step's forward runs the layers before it
    #   (time/optimizer then counts the gradient norm only; a wait for an update shows in time/fwd_bwd)
    allreduce_overlap: bool = False  # 2+ drafters: the gradient all-reduce in buckets (the optimizer's
    #   segments: one per layer with optimizer_overlap) launched during backward as each bucket's
    #   gradients are in, as DDP does; the same sums. Off by default until measured on 2+ GPUs.
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16: bf16 working weights, fp32 master
    #   weights and moments | amp: fp32 weights under bf16 autocast (casts every weight every step) | fp32
    # After SIGTERM: the job stops within 2*logging.log_every steps with a checkpoint; a rank still
    # running this long after the signal exits non-zero (Slurm's KillWait and torchrun's shutdown
    # wait are 30 s: keep it below both, or raise them).
    stop_grace_s: float = 25.0
    feature_noise: str = "none"  # none | uniform | gaussian: noise added to the target's context features
    #   in training steps only (never evaluation or export), so the drafter tolerates features that
    #   differ a little from the ones it trained on (another kernel, dtype or batch at serving time)
    feature_noise_scale: float = 0.05  # noise std relative to each token's per-layer feature RMS
    cublas_workspace: str = "none"  # cuBLAS's workspace in a drafter's process (blas.py): none (the
    #   default on CUDA: no memset before the step's GEMMs, BENCHMARKS.md calls H2-H4) | torch
    #   (PyTorch's sizes). Environment variables already set win.
    reduction_configs: str = "heuristic"  # how Inductor picks each compiled reduction kernel's config
    #   (reductions.py): heuristic (the default on CUDA: from the kernel's shape, the same in every
    #   compile) | timed (timed at the kernel's first run; its picks vary from compile to compile)
    cuda_graph: bool = True  # CUDA, one drafter replica, Triton block attention: the whole step
    #   (forward, backward, clipping, AdamW) is captured as one CUDA graph after two launched steps
    #   and replayed from then on (step_graph.py); where it cannot be, the choices table says why


FEATURE_NOISE = ("none", "uniform", "gaussian")


def add_feature_noise(hidden: torch.Tensor, kind: str, scale: float, num_layers: int) -> torch.Tensor:
    """`hidden` [T, num_layers * H] plus zero-mean noise of std `scale` x the RMS of each token's
    features of each captured layer (layers differ in scale by orders of magnitude). Drawn on the
    device from the global generator, inside whatever graph the step is compiled into."""
    x = hidden.float().unflatten(-1, (num_layers, -1))
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    if kind == "gaussian":
        eps = torch.randn_like(x)
    else:  # uniform on [-sqrt(3), sqrt(3)]: unit variance, like the Gaussian
        eps = (torch.rand_like(x) * 2 - 1) * math.sqrt(3.0)
    return (x + (scale * rms) * eps).flatten(-2).to(hidden.dtype)


def build_drafter_args(cfg: DrafterConfig, target: TargetSpec, layer_ids: list[int], mask_token_id: int) -> DrafterArgs:
    """Drafter hyper-parameters: the user's, with gaps filled from the target's shape (a TargetSpec,
    or the config dict it is read from)."""
    if isinstance(target, dict):
        target = TargetSpec.from_config(target)
    if not (cfg.intermediate_size or target.intermediate_size):
        raise ValueError("the target's config has no dense intermediate_size (a mixture-of-experts model) to give "
                         "the drafter's MLP its width: set drafter.intermediate_size (e.g. the routed experts' width "
                         "x experts per token).")
    heads = cfg.num_heads or target.num_heads
    return DrafterArgs(
        hidden_size=target.hidden_size,
        intermediate_size=cfg.intermediate_size or target.intermediate_size,
        num_layers=cfg.num_layers,
        num_heads=heads,
        num_kv_heads=cfg.num_kv_heads or target.num_kv_heads,
        head_dim=cfg.head_dim or target.head_dim,
        vocab_size=target.vocab_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings,
        target_layer_ids=list(layer_ids),
        block_size=cfg.block_size,
        mask_token_id=mask_token_id,
        layer_types=list(cfg.layer_types) if cfg.layer_types else None,
        sliding_window=cfg.sliding_window,
    )


class DFlashObjective(nn.Module):
    """HiddenBatch tensors -> (loss, per-block stats). Frozen embedding / LM head are buffers."""

    def __init__(self, drafter: DFlashDrafter, args: DrafterArgs, embed: torch.Tensor, head: torch.Tensor,
                 cfg: DrafterConfig):
        super().__init__()
        self.drafter = drafter
        self.args = args
        self.cfg = cfg
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("head", head.detach(), persistent=False)
        self.register_buffer("weights", slot_weights(args.block_size, cfg.gamma, device=embed.device),
                             persistent=False)
        # drafter.attention resolved once (auto: the Triton block kernels on CUDA where they apply).
        self.attention = drafter.attention_backend(cfg.attention, embed.device)
        self.loss_kernel = "eager"  # set by compile_objective
        self.feature_noise: tuple[str, float] = ("none", 0.0)  # set by DrafterTrainer (training only)
        # The dtype the drafter computes in: features arrive in the target's (a bf16 target may feed an
        # fp32 drafter). Set by DrafterTrainer (bf16 under autocast); None: the weights' own.
        self.compute_dtype: torch.dtype | None = None
        # The first layer projects a block's mask slots once and the last computes slots 1..B-1 only
        # (DFlashDrafter.forward's training form); False: every block row through every layer, the
        # same numbers (bench/drafter_step.py's `+fullrows` times both).
        self.shared_mask_rows = True

    def forward(self, hidden, input_ids, position_ids, doc_ids, loss_mask, noise):
        b = self.args.block_size
        dtype = self.compute_dtype or self.drafter.fc.weight.dtype
        if hidden.dtype != dtype:
            hidden = hidden.to(dtype)
        kind, scale = self.feature_noise
        if kind != "none" and self.training:
            hidden = add_feature_noise(hidden, kind, scale, len(self.args.target_layer_ids))
        anchors, valid = sample_anchors(loss_mask, doc_ids, self.cfg.num_anchors, self.cfg.max_anchors_per_doc,
                                        noise=noise)
        labels, label_mask = block_labels(input_ids, loss_mask, doc_ids, anchors, valid, b)
        block_ids, block_pos = build_blocks(input_ids, position_ids, anchors, b, self.args.mask_token_id)
        attn = self.drafter.build_attention(anchors, valid, doc_ids, backend=self.attention,
                                            flex_block_size=self.cfg.flex_block_size,
                                            kernel_options=self.cfg.flex_kernel_options)
        if self.shared_mask_rows:
            out = self.drafter.predict_blocks(hidden, self.embed, input_ids, anchors, position_ids, block_pos, attn)
        else:
            block_embeds = F.embedding(block_ids, self.embed).to(hidden.dtype)
            out = self.drafter(hidden, block_embeds, position_ids, block_pos, attn)
        loss, correct = dflash_loss(out, self.head, labels, label_mask, self.weights, self.cfg.loss_chunk_size,
                                    kernel=self.loss_kernel)
        # Visible context keys per block = tokens of its document before the anchor = position_ids[a].
        ctx_keys = (position_ids[anchors] * valid).sum()
        return loss, correct, label_mask, ctx_keys


def lr_at(step: int, num_steps: int, cfg: TrainConfig) -> float:
    warm = max(1, math.ceil(cfg.warmup_ratio * num_steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, num_steps - warm)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


# torch.compile modes that record CUDA graphs.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def resolve_compile_mode(mode: str, device: torch.device) -> str:
    # auto: the fastest mode measured on the H200 that runs under torchrun (BENCHMARKS.md).
    return resolve_auto("train.compile", mode, device, cuda="default", cpu="eager",
                        allowed=("eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))


def resolve_precision(precision: str, device: torch.device) -> str:
    return resolve_auto("train.precision", precision, device, cuda="bf16", cpu="fp32",
                        allowed=("bf16", "amp", "fp32"))


def resolve_loss_kernel(kernel: str, mode: str, device: torch.device) -> str:
    if kernel == "auto":
        return "triton" if mode != "eager" and ce_kernels.available(device) else "eager"
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"train.loss_kernel={kernel!r}: use auto or one of {LOSS_KERNELS}")
    if kernel == "triton" and not ce_kernels.available(device):
        raise ValueError(f"train.loss_kernel=triton needs CUDA and the triton package (device {device}); "
                         "use inductor or eager")
    return kernel


def layer_scope_modules(drafter: DFlashDrafter) -> tuple[nn.Module, ...]:
    """What `train.compile_scope=layers` compiles, one graph each: the decoder layers and the two RMSNorms
    outside them (eagerly, each is ~10 memory-bound kernels over [rows, hidden] in fp32 forward and
    backward)."""
    return (*drafter.layers, drafter.hidden_norm, drafter.norm)


def compile_objective(objective: DFlashObjective, mode: str, scope: str, loss_kernel: str = "eager"):
    """`loss_kernel`: a resolved LOSS_KERNELS value, used by eager mode and layers scope."""
    objective.loss_kernel = loss_kernel
    if mode == "eager":
        return objective
    if scope == "step":
        return torch.compile(objective, mode=mode, dynamic=False)
    if scope == "layers":
        for module in layer_scope_modules(objective.drafter):
            module.compile(mode=mode, dynamic=False)
        return objective
    raise ValueError(f"train.compile_scope={scope!r}: use step or layers.")


class DrafterTrainer:
    def __init__(self, objective: DFlashObjective, cfg: TrainConfig, num_steps: int, group,
                 device: torch.device, write_grads: bool = True, direct_grads: bool = True,
                 split_master: bool = True):
        """`write_grads=False`: the older add-into-`.grad` scheme; `direct_grads=False`: the flat
        gradient buffer even where the update could read `.grad` itself; `split_master=False`: a
        separate fp32 master beside bf16 working weights (FlatAdamW; all three for the bench's
        comparisons)."""
        self.objective = objective
        self.cfg = cfg
        self.num_steps = num_steps
        self.device = device
        self.step = 0
        self.mode = resolve_compile_mode(cfg.compile, device)
        self.precision = resolve_precision(cfg.precision, device)
        self.autocast = self.precision != "fp32"
        # Rebinds the parameters to its flat buffers, so it comes before compiling.
        named = [(n, p) for n, p in objective.drafter.named_parameters() if p.requires_grad]
        self.graph_why = "train.cuda_graph=false" if not cfg.cuda_graph else graph_unsupported(
            device, self.mode, replicas(group), objective.attention)
        # The drafter's forward runs in Python between layers only in eager mode and layers scope:
        # there it can wait for each layer's update just before the layer runs. Not with CUDA
        # graphs: the 8B step was much slower there, its graphs re-recorded (BENCHMARKS.md).
        # Not in a captured step either: there the update runs after backward, in the graph.
        overlap = (cfg.optimizer_overlap and self.mode != "reduce-overhead" and self.graph_why is not None
                   and (self.mode == "eager" or cfg.compile_scope == "layers"))
        self.opt = FlatAdamW(named, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                             dtype=torch.bfloat16 if self.precision == "bf16" else torch.float32, group=group,
                             compiled=device.type == "cuda",  # one kernel; eager mode compiles only this
                             write_grads=write_grads,  # False: the older add-into-.grad scheme (bench)
                             # Per layer also in a captured step: identical layers share one compiled update.
                             segments=_layer_segments([n for n, _ in named])
                             if overlap or self.graph_why is None else None,
                             side_stream=overlap, overlap_reduce=cfg.allreduce_overlap,
                             # Under CUDA graphs `.grad` may live in a graph's output pool, which the
                             # next replay overwrites: copy it into the flat buffer at once there.
                             direct_grads=direct_grads and self.mode not in CUDA_GRAPH_MODES,
                             split_master=split_master)
        objective.drafter.before_module = self.opt.wait if overlap else None
        self.params = self.opt.params
        self.loss_kernel = resolve_loss_kernel(cfg.loss_kernel, self.mode, device)
        if cfg.feature_noise not in FEATURE_NOISE or cfg.feature_noise_scale < 0:
            raise ValueError(f"train.feature_noise={cfg.feature_noise!r}, train.feature_noise_scale="
                             f"{cfg.feature_noise_scale}: use one of {FEATURE_NOISE} and a scale >= 0 (e.g. 0.05)")
        # Python constants of the step: fixed for the run, so they never trigger a recompile.
        objective.feature_noise = (cfg.feature_noise, float(cfg.feature_noise_scale))
        objective.compute_dtype = torch.bfloat16 if self.autocast else None
        if not self.autocast:  # the target's embedding and head come in its dtype (bf16 for a bf16 target)
            dtype = objective.drafter.fc.weight.dtype
            objective.embed, objective.head = objective.embed.to(dtype), objective.head.to(dtype)
        self.fwd = compile_objective(objective, self.mode, cfg.compile_scope, self.loss_kernel)
        b = objective.args.block_size
        self.stats = IntervalStats(b, device)
        self._marks: _Marks | None = None  # time points of the last timed step
        self.graph = StepGraph(device) if self.graph_why is None else None
        # The parameters' first tensors (now copied into the flat buffers) and the target head's fp32
        # draw are free blocks in the allocator's cache: given back before the first step lays out its
        # activations beside them.
        give_back_cached(device, "drafter trainer")

    def describe_graph(self) -> str:
        """The step as a CUDA graph, for the choices table and the log."""
        return describe_state(self.graph, self.graph_why,
                              f"captured at this process's step {CAPTURE_AT}, replayed from then on",
                              "the steps run launched")

    def train_step(self, hb: HiddenBatch, timed: bool = False, after_backward=None) -> float:
        """One optimizer step on this rank's batch; gradients averaged over the drafter group.

        `timed`: record where this step's time goes (`phase_ms()`), without a host sync.
        `after_backward`: called between this rank's backward and the gradient all-reduce.
        """
        lr = self.set_lr()
        if self.graph is None:
            self._launched_step(hb, timed, after_backward)
            return lr
        inputs = [hb.hidden, hb.input_ids, hb.position_ids, hb.doc_ids, hb.loss_mask]
        with self.graph.on_stream():
            replayed = False
            if not self.graph.launching and after_backward is None and self.graph.fits(inputs):
                replayed = self._replay(hb, inputs, timed)  # False: the capture failed
            if not replayed:
                self._launched_step(hb, timed, after_backward)
                self.graph.launched()
        return lr

    def _replay(self, hb: HiddenBatch, inputs: list[torch.Tensor], timed: bool) -> bool:
        """This step as the captured graph (captured now if it is not yet); False if the capture failed."""
        marks = _Marks(self.device) if timed else None
        self.opt.load_lr()  # outside the graph, which reads the 0-d tensor
        if not self.graph.run(self._graph_body, inputs, undo=self._undo_capture):
            return False
        self.stats.count(hb.num_valid_tokens)
        self.step += 1
        if marks:
            marks.add("step")
            self._marks = marks
        return True

    def _graph_body(self, hidden, input_ids, position_ids, doc_ids, loss_mask) -> None:
        """The device work of one step, as the graph records it."""
        self._forward_backward(hidden, input_ids, position_ids, doc_ids, loss_mask)
        gnorm, skipped = self.opt.step_(self.cfg.grad_clip, load_lr=False)
        self.stats.add_gnorm(gnorm, skipped)

    def _undo_capture(self) -> None:
        """A capture failed part-way: drop what it left on the host (gradients from its pool)."""
        for p in self.params:
            p.grad = None
        self.opt.reset_grads()

    def _launched_step(self, hb: HiddenBatch, timed: bool, after_backward) -> None:
        marks = _Marks(self.device) if timed else None
        self.forward_backward(hb)
        if after_backward is not None:
            after_backward()
        if marks:
            marks.add("fwd_bwd")
        self.opt.allreduce()
        if marks:
            marks.add("allreduce")
        self.optimizer_step()
        if marks:
            marks.add("optimizer")
            self._marks = marks

    def phase_ms(self) -> dict[str, float]:
        """{fwd_bwd, allreduce, optimizer: ms} of the last timed step ({step: ms} where it was a CUDA graph
        replay: one unit), then forgotten ({} if none).
        Read it where the host has synchronised anyway (the logging step): on CUDA the phases are
        events in the stream, done by then."""
        marks, self._marks = self._marks, None
        return marks.read() if marks else {}

    def set_lr(self) -> float:
        self.opt.lr = lr_at(self.step, self.num_steps, self.cfg)
        return self.opt.lr

    def forward_backward(self, hb: HiddenBatch, grad_scale: float = 1.0) -> torch.Tensor:
        loss = self._forward_backward(hb.hidden, hb.input_ids, hb.position_ids, hb.doc_ids, hb.loss_mask,
                                      grad_scale)
        self.stats.count(hb.num_valid_tokens)
        return loss

    def _forward_backward(self, hidden, input_ids, position_ids, doc_ids, loss_mask,
                          grad_scale: float = 1.0) -> torch.Tensor:
        """Forward, backward and the interval's device sums (no host state: a graph records it)."""
        # Anchor randomness is drawn eagerly (one tiny kernel), so every compile mode and the
        # one-process reference see the same anchors for the same RNG state.
        noise = torch.rand(2, input_ids.shape[0], device=self.device)
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, correct, label_mask, ctx_keys = self.fwd(hidden, input_ids, position_ids, doc_ids, loss_mask,
                                                           noise)
        (loss * grad_scale if grad_scale != 1.0 else loss).backward()
        self.opt.collect()
        self.stats.add(loss.detach(), correct, label_mask, ctx_keys)
        return loss.detach()

    def optimizer_step(self) -> None:
        """Clip + AdamW (`FlatAdamW.step_`), with no host sync.

        The global norm is one reduction over the gradients; the clip factor and the
        data-parallel mean divide the gradient inside the update pass, and a non-finite norm skips
        the update there (weights, moments and step count untouched), so one bad batch costs a
        skipped step, not NaN weights. Skips are counted (`drafter/skipped_steps`).
        """
        gnorm, skipped = self.opt.step_(self.cfg.grad_clip)
        self.stats.add_gnorm(gnorm, skipped)
        self.step += 1

    def master_state_dict(self) -> Mapping[str, torch.Tensor]:
        """The drafter's weights at full precision (fp32 master), named as `drafter.state_dict()`, in its
        order: the trainable ones read from the optimizer (FlatAdamW.named_master, joined on each read
        where the master is split), the rest from the drafter."""
        return ChainMap(self.opt.named_master(), self.objective.drafter.state_dict())

    def state_dict(self) -> dict:
        return {"drafter": self.master_state_dict(), "optimizer": self.opt.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["drafter"], state["optimizer"])
        self.step = state["step"]


def _layer_segments(names: list[str]) -> list[list[str]]:
    """Optimizer segments in the order the forward needs them: the weights outside the decoder
    layers (the context projection comes first), then one segment per layer."""
    groups: dict[str, list[str]] = {"": []}
    for n in names:
        parts = n.split(".")
        groups.setdefault(".".join(parts[:2]) if parts[0] == "layers" else "", []).append(n)
    return [g for g in groups.values() if g]


class _Marks:
    """Time points of one step: CUDA events recorded in the stream (no sync), or wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.points: list[tuple[str, object]] = [("start", self._now())]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, name: str) -> None:
        self.points.append((name, self._now()))

    def read(self) -> dict[str, float]:
        out = {}
        for (_, a), (name, b) in zip(self.points, self.points[1:]):
            if self.cuda:
                b.synchronize()  # already complete where this is called; no real wait
                out[name] = a.elapsed_time(b)
            else:
                out[name] = 1000 * (b - a)
        return out


class IntervalStats:
    """Device-side sums over a logging interval; `pop()` is the one host sync."""

    def __init__(self, block_size: int, device: torch.device):
        self.b = block_size
        self.device = device
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        self.loss, self.gnorm, self.ctx_keys = z(()), z(()), z(())
        self.slot_correct, self.slot_count = z(block_size), z(block_size)
        self.tau_sum, self.blocks, self.skipped = z(()), z(()), z(())
        self.steps = 0
        self.valid_tokens = 0

    def _sums(self) -> list[torch.Tensor]:
        return [self.loss, self.gnorm, self.ctx_keys, self.slot_correct, self.slot_count, self.tau_sum, self.blocks,
                self.skipped]

    def reset(self) -> None:
        # Zeroed in place: a captured step (step_graph.py) adds into these very tensors.
        torch._foreach_zero_(self._sums())
        self.steps = 0
        self.valid_tokens = 0

    def add_gnorm(self, gnorm, skipped) -> None:
        self.gnorm += gnorm.double()
        self.skipped += skipped.double()

    def count(self, valid_tokens: int) -> None:
        """The host's part of a step: one more step of `valid_tokens` tokens."""
        self.steps += 1
        self.valid_tokens += valid_tokens

    def add(self, loss, correct, label_mask, ctx_keys) -> None:
        """The device's part of a step (no host state: a captured step records it)."""
        hit = correct & label_mask
        self.loss += loss.double()
        self.ctx_keys += ctx_keys.double()
        self.slot_correct += hit.sum(0).double()
        self.slot_count += label_mask.sum(0).double()
        block_valid = label_mask[:, 1]
        lead = torch.cumprod(hit[:, 1:].long(), dim=1).sum(1)
        self.tau_sum += ((1 + lead) * block_valid).sum().double()
        self.blocks += block_valid.sum().double()

    def pop(self) -> dict[str, torch.Tensor | float]:
        """Per-rank sums, ready for a sum-reduction over the group (copies: the sums restart at 0)."""
        loss, gnorm, ctx_keys, correct, count, tau, blocks, skipped = (t.clone() for t in self._sums())
        out: dict[str, torch.Tensor | float] = {
            "loss_sum": loss, "gnorm_sum": gnorm, "ctx_keys": ctx_keys, "tau_sum": tau, "blocks": blocks,
            "skipped": skipped, "steps": float(self.steps), "valid_tokens": float(self.valid_tokens),
        }
        for k in range(1, self.b):
            out[f"slot_correct_{k}"] = correct[k]
            out[f"slot_count_{k}"] = count[k]
        self.reset()
        return out
