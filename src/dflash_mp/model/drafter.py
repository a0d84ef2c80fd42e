"""The DFlash drafter: Qwen3-style decoder layers whose keys and values include the target's context.

Module names equal the public export names (`layers.{i}.self_attn.q_proj`, `fc`, `hidden_norm`,
...), so `state_dict()` is the exported checkpoint as it is. The drafter owns no embedding and no
LM head: block inputs are rows of the target's frozen embedding and logits come from the target's
frozen LM head, both handled by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_mp.model.attention import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    BlockAttention,
    build_block_attention,
    resolve_backend,
)
from dflash_mp.model.block_attn import unsupported
from dflash_mp.triton_launch import shared_memory

# Plain RoPE is computed here; the scaled types come from transformers' own init functions. Types
# whose frequencies depend on the runtime sequence length (dynamic, longrope) are left out: training
# and inference would disagree.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass
class DrafterArgs:
    """Shape and semantics of one drafter; the export `config.json` is derived from it."""

    hidden_size: int  # H, equal to the target's hidden size (block inputs are its embedding rows)
    intermediate_size: int  # SwiGLU inner width
    num_layers: int  # drafter decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA); must divide num_heads
    head_dim: int  # per-head width (Qwen3 sets it independently of hidden_size)
    vocab_size: int  # the target's vocabulary (rows of its embedding / LM head)
    target_layer_ids: list[int]  # target layers whose outputs form the context, in concat order
    mask_token_id: int  # embedding row fed to the masked slots of a block
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_theta: float = 1e6  # RoPE base
    rope_scaling: dict | None = None  # HF-style RoPE scaling dict ({"rope_type": ..., ...}) or None
    max_position_embeddings: int = 40960  # longest position the RoPE tables are meant for
    block_size: int = 16  # B: anchor token plus B-1 masked slots
    layer_types: list[str] | None = None  # per layer "full_attention" / "sliding_attention"; None = all full
    sliding_window: int | None = None  # window W of sliding layers; required iff any layer slides

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers}: a drafter needs at least one decoder layer "
                             "(drafter.num_layers, 5 at the recipe's shapes)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}; "
                "pick num_kv_heads among the divisors of num_heads"
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty; list the target layers to capture, e.g. [1, 9, 17]")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} leaves no slot to predict; use >= 2 (default 16)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}); "
                "use an unused row of the target's embedding"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}; "
                    "give one per layer or None for all full attention"
                )
            bad = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
            if bad:
                raise ValueError(f"layer_types has {bad}; use {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}")
        if self.has_sliding and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(
                f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}; set it "
                "or make every layer full_attention"
            )
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is unsupported; use one of {SUPPORTED_ROPE_TYPES}"
            )

    @property
    def num_target_layers(self) -> int:
        """Number of captured target layers K (the context width is K * hidden_size)."""
        return len(self.target_layer_ids)

    @property
    def resolved_layer_types(self) -> list[str]:
        return list(self.layer_types) if self.layer_types else [FULL_ATTENTION] * self.num_layers

    @property
    def has_sliding(self) -> bool:
        return SLIDING_ATTENTION in (self.layer_types or [])

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))


def default_target_layer_ids(num_target_layers: int, num_context_layers: int) -> list[int]:
    """`num_context_layers` ids spread evenly from layer 1 to L-3 (L=36, K=5: [1, 9, 17, 25, 33])."""
    if num_context_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_context_layers - 1)) for i in range(num_context_layers)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the input dtype, as Qwen3 does, so exported weights give
        # the same numbers in the public inference code. Casting the weight too keeps the output in
        # the input dtype under autocast with fp32 master weights (else q/k turn fp32 and v not).
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, args: DrafterArgs) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = _rope_inv_freq(args)
        # Non-persistent: derived from the config, so never part of the checkpoint.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._inv_freq_fp32 = inv_freq.clone()

    def _apply(self, fn, *args, **kwargs):
        # `module.to(torch.bfloat16)` would round inv_freq to 8 mantissa bits, i.e. rotation errors
        # of radians at positions in the thousands. Follow device moves (and `to_empty` after meta
        # init) but restore the exact fp32 values.
        out = super()._apply(fn, *args, **kwargs)
        self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)
        return out

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[S]` -> (cos, sin) `[S, head_dim]`, computed in fp32."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rope_inv_freq(args: DrafterArgs) -> tuple[torch.Tensor, float]:
    if args.rope_type == "default":
        exponents = torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim
        return 1.0 / (args.rope_theta**exponents), 1.0
    # Scaled variants: reuse transformers' implementations so numbers match the exported model.
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads,
        head_dim=args.head_dim,
        rope_theta=args.rope_theta,
        rope_scaling=dict(args.rope_scaling),
        max_position_embeddings=args.max_position_embeddings,
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[args.rope_type](config, None)
    return inv_freq.float(), float(scaling)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[S, heads, D]` rotated by the tables cos/sin `[S, D]` of its S positions, in transformers'
    rotate-half form (dimension j paired with j + D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat([-x2, x1], dim=-1) * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, args: DrafterArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.block_size = args.block_size
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor],
        attn: BlockAttention,
        sliding: bool,
        shared_mask: bool = False,
        drop_anchor: bool = False,
    ) -> torch.Tensor:
        """x: normalised block tokens `[Q, H]`; ctx: fused context `[T, H]` -> `[Q, H]`.

        `shared_mask`: x holds each block's anchor row, then the one mask row every other slot shares
        (`[A + 1, H]`, see `spread_blocks`); its projections are spread over the `A*B` block rows before
        RoPE. `drop_anchor`: the output holds slots 1..B-1 only (`[A*(B-1), H]`)."""
        D = self.head_dim
        q = self.q_norm(self.q_proj(x).view(x.shape[0], self.num_heads, D))
        kx, vx = self.k_proj(x), self.v_proj(x)
        if shared_mask:
            q, kx, vx = (spread_blocks(t, self.block_size) for t in (q, kx, vx))
        n_q = q.shape[0]
        # KV injection: the context is projected by the same k/v weights as the block tokens and
        # put in front of them, so one attention call covers both.
        k = torch.cat([self.k_proj(ctx), kx], dim=0).view(-1, self.num_kv_heads, D)
        v = torch.cat([self.v_proj(ctx), vx], dim=0).view(-1, self.num_kv_heads, D)
        k = self.k_norm(k)
        q = _apply_rope(q, *rope_q)
        k = _apply_rope(k, *rope_k)
        out = attn(q, k, v, sliding).reshape(n_q, self.num_heads * D)  # [S, heads, D] in and out
        if drop_anchor:
            out = drop_anchors(out, self.block_size)
        return self.o_proj(out)


def spread_blocks(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[A + 1, ...]` (A anchors' rows, then the mask row) -> `[A*B, ...]`: each block is its anchor's
    row followed by B-1 copies of the mask row.

    Until RoPE, a block's mask slots hold equal rows in the first layer (the embedding of
    `mask_token_id`, then per-row norms and projections), so that layer projects A + 1 rows instead
    of A*B: at 8B shapes 15/16 of its q/k/v projections (fwd and both grads, ~1.2 TFLOP a step)."""
    a = t.shape[0] - 1
    return torch.cat([t[:a, None], t[a:, None].expand(a, block_size - 1, *t.shape[1:])], dim=1).flatten(0, 1)


def drop_anchors(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[A*B, ...]` -> `[A*(B-1), ...]`: slots 1..B-1 of every block (slot 0, the anchor, predicts nothing)."""
    return t.unflatten(0, (-1, block_size))[:, 1:].flatten(0, 1)


class MLP(nn.Module):
    # The MLP as one function of (x, gate, up and down weights) in place of the modules' own ops:
    # bench/drafter_step.py's `+swiglu` sets swiglu.swiglu_mlp (the SwiGLU inside the GEMMs, forward and
    # backward). Off: the step ran slower with it (BENCHMARKS.md, calls M1-M2).
    fused = None

    def __init__(self, args: DrafterArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: DrafterArgs, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, attn: BlockAttention, shared_mask: bool = False,
                drop_anchor: bool = False) -> torch.Tensor:
        """`shared_mask`, `drop_anchor`: see Attention.forward (the first and the last layer of a
        training step); the residual follows the same rows."""
        h = self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, attn, self.sliding, shared_mask, drop_anchor)
        if shared_mask:
            x = spread_blocks(x, self.self_attn.block_size)
        if drop_anchor:
            x = drop_anchors(x, self.self_attn.block_size)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """N decoder layers over `A` blocks of one packed row, with the fused target context as extra
    keys/values in every layer. Plain module: wrapping, compile and transport live elsewhere."""

    def __init__(self, args: DrafterArgs) -> None:
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(
            DecoderLayer(args, sliding=t == SLIDING_ATTENTION) for t in args.resolved_layer_types
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.fc = nn.Linear(args.num_target_layers * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args)
        # Called with a submodule's name ("fc", "layers.0", ...) just before it runs, outside any
        # compiled layer: the trainer waits there for that module's optimizer update.
        self.before_module: Callable[[str], None] | None = None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) linears and unit norms, the HF initialiser the public checkpoints start from."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def attention_backend(self, backend: str, device: torch.device | str) -> str:
        """`drafter.attention` resolved for this drafter's shapes on `device` (attention.resolve_backend)."""
        if torch.compiler.is_compiling():  # resolved and checked before the compile (DFlashObjective)
            return resolve_backend(backend, device)
        a = self.args
        why = unsupported(a.num_heads, a.num_kv_heads, a.head_dim, a.block_size,
                          shared_memory(torch.device(device)))
        return resolve_backend(backend, device, why)

    def build_attention(
        self,
        anchors: torch.Tensor,
        anchor_valid: torch.Tensor,
        doc_ids: torch.Tensor,
        backend: str = "auto",
        flex_block_size: int | tuple[int, int] = 128,
        kernel_options: dict | None = None,
    ) -> BlockAttention:
        """The per-step masks for this drafter's layer kinds (one per kind, shared by all layers)."""
        return build_block_attention(
            anchors,
            anchor_valid,
            doc_ids,
            self.args.block_size,
            layer_types=self.args.resolved_layer_types,
            sliding_window=self.args.sliding_window,
            backend=self.attention_backend(backend, doc_ids.device),
            flex_block_size=flex_block_size,
            kernel_options=kernel_options,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        block_embeds: torch.Tensor,
        ctx_positions: torch.Tensor,
        block_positions: torch.Tensor,
        attn: BlockAttention,
        mask_embed: torch.Tensor | None = None,
        predicted_only: bool = False,
    ) -> torch.Tensor:
        """One packed row: hidden `[T, K*H]`, block_embeds `[A*B, H]` -> block hidden `[A*B, H]`.

        `ctx_positions` `[T]` and `block_positions` `[A*B]` are the RoPE positions (per document);
        `attn` comes from `build_attention` for the same anchors. Inputs must match the weights'
        dtype, or run under autocast (bf16 activations over fp32 master weights).

        The training step's form, the same numbers for the slots it returns: with `mask_embed` `[H]`,
        block_embeds is the anchors' rows `[A, H]` and every other slot of a block is `mask_embed`
        (the first layer projects A + 1 rows, `spread_blocks`); with `predicted_only`, the output is
        slots 1..B-1, `[A*(B-1), H]`, and the last layer runs its o_proj and MLP on those rows only
        (slot 0's last output feeds nothing: 1/16 of that layer's o_proj and MLP at B = 16).
        """
        dtype = block_embeds.dtype
        before = self.before_module or _nothing
        before("fc")
        before("hidden_norm")
        # Fused and normalised once; every layer reuses it (no per-layer renormalisation).
        ctx = self.hidden_norm(self.fc(hidden))
        rope_q = self.rotary_emb(block_positions, dtype)
        rope_c = self.rotary_emb(ctx_positions, dtype)
        rope_k = (torch.cat([rope_c[0], rope_q[0]]), torch.cat([rope_c[1], rope_q[1]]))
        x = block_embeds
        if mask_embed is not None:
            x = torch.cat([block_embeds, mask_embed.reshape(1, -1).to(dtype)])
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            before(f"layers.{i}")
            x = layer(x, ctx, rope_q, rope_k, attn, shared_mask=mask_embed is not None and i == 0,
                      drop_anchor=predicted_only and i == last)
        before("norm")
        return self.norm(x)

    def predict_blocks(self, hidden: torch.Tensor, embed: torch.Tensor, input_ids: torch.Tensor,
                       anchors: torch.Tensor, ctx_positions: torch.Tensor, block_positions: torch.Tensor,
                       attn: BlockAttention) -> torch.Tensor:
        """The blocks' predicted slots 1..B-1, `[A*(B-1), H]`, in the training step's form: block inputs are
        rows of the target's frozen `embed`, the anchors' tokens and the mask token for every other slot."""
        anchor_rows = F.embedding(input_ids[anchors], embed).to(hidden.dtype)
        return self(hidden, anchor_rows, ctx_positions, block_positions, attn,
                    mask_embed=embed[self.args.mask_token_id], predicted_only=True)


def _nothing(name: str) -> None:
    pass
