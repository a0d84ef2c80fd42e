"""A DFlash drafter as a transformers model, shipped inside every export so that

    AutoModel.from_pretrained(export_dir, trust_remote_code=True)

loads it the way the public DFlash drafters load. Self-contained on purpose (torch and transformers
only): transformers copies this one file into its module cache and imports it there.

The interface is the public `DFlashDraftModel`'s: `forward(position_ids, noise_embedding=,
target_hidden=, past_key_values=, use_cache=)` returns the block's hidden states; `target_layer_ids`,
`block_size`, `mask_token_id` and `compute_logits` are there, so the public `dflash_generate` can
drive it. Weight names are the export's (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, ...).

What one call computes: the target's captured features `target_hidden` [batch, ctx, K*H] are fused
by `fc` and `hidden_norm` into one context row per position. In every layer, the block's queries
attend to keys and values made by the layer's own k/v projections from both the context and the
block (context first; with a cache, earlier calls' keys precede them). Full-attention layers see
every key; sliding-attention layers see the keys at or before the query's index within the window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


def _dflash_value(config, name: str, default=None):
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, S, D]; cos/sin [batch, S, D]."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


class _Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.layer_idx = layer_idx
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.heads
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = _RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = _RMSNorm(self.head_dim, config.rms_norm_eps)
        kinds = getattr(config, "layer_types", None) or []
        sliding = layer_idx < len(kinds) and kinds[layer_idx] == "sliding_attention"
        self.window = config.sliding_window if sliding else None

    def forward(self, x, ctx, cos, sin, cache=None):
        b, q_len, _ = x.shape
        both = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(b, both.shape[1], self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(b, both.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos[:, -q_len:], sin[:, -q_len:]), _rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, {"cos": cos, "sin": sin})
        mask = None
        if self.window is not None:
            n_k = k.shape[2]
            qi = torch.arange(n_k - q_len, n_k, device=x.device)[:, None]
            ki = torch.arange(n_k, device=x.device)[None, :]
            mask = (ki <= qi) & (qi - ki < self.window)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class _MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = _Attention(config, layer_idx)
        self.mlp = _MLP(config)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["_Layer"]

    def __init__(self, config) -> None:
        super().__init__(config)
        self.target_layer_ids = list(_dflash_value(config, "target_layer_ids"))
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = _dflash_value(config, "mask_token_id")
        # The template options the training data was rendered with: render prompts the same way.
        self.chat_template_kwargs = dict(_dflash_value(config, "chat_template_kwargs", None) or {})
        h = config.hidden_size
        self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = _RMSNorm(h, config.rms_norm_eps)
        self.norm = _RMSNorm(h, config.rms_norm_eps)
        # transformers' own rotary module: its initialisation (RoPE tables of scaled types included) is
        # the one from_pretrained restores after building the model on the meta device.
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, position_ids: torch.LongTensor, attention_mask=None, noise_embedding: torch.Tensor | None = None,
                target_hidden: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                **kwargs) -> torch.Tensor:
        """`noise_embedding` [batch, q, H]: target embeddings of the block (anchor, then mask tokens);
        `target_hidden` [batch, ctx, K*H]: captured features of the positions not yet in the cache;
        `position_ids` [batch, ctx + q]: their positions. Returns the block's hidden states [batch, q, H]."""
        if attention_mask is not None:
            raise ValueError("attention_mask is not supported: the layers build their own masks")
        x = noise_embedding
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(x, position_ids)
        cache = past_key_values if use_cache or past_key_values is not None else None
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """Logits of the block's hidden states through the target's LM head."""
        return output_head(hidden)
