"""Multi-head latent attention (MLA): DeepSeek-V3's attention (Kimi K2's too), the attention part of the
Llama family's `deepseek_v3` variant, as transformers' DeepseekV3Attention computes it.

Keys and values are not cached per head: each token leaves one compressed latent of `kv_lora_rank`
values (normed) and one rotated key of `qk_rope_head_dim` values that every head shares, side by side
in one cache entry of kv_lora_rank + qk_rope_head_dim values (`latent_layout`: 576 for DeepSeek-V3,
where 128 heads' keys and values would take 32768). Head h's key is [W_UK[h] latent, rotated key] and
its value W_UV[h] latent, W_UK and W_UV being `kv_b_proj`'s two halves.

A segment's attention is computed from the latent in one of two ways, whichever takes fewer
multiply-adds for its shapes (`absorbs`), both within float rounding of transformers':
- expanded, as transformers does: kv_b_proj over every cached latent gives each head's keys and values
  (a prompt: every key is needed anyway);
- absorbed: W_UK folded into the queries (q_nope W_UK, a query of kv_lora_rank values per head) and
  W_UV applied after attention, so that every head attends over the latent itself, one shared key and
  value head, and nothing of the past is expanded (a decode step: cost per cached token
  heads x (2 kv_lora_rank + qk_rope_head_dim), not kv_lora_rank x heads x (qk_nope + v)).
kv_b_proj is therefore kept as a plain weight, never quantized, like a router: the absorbed path
multiplies by its halves.

Queries' and keys' rotation is DeepSeek's interleaved one where `rope_interleave` (pairs (x0, x1), ...
rotated, laid out evens then odds, as transformers lays them), else the Llama family's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import grouped_attention
from .kv_cache import CacheLayout, CachePart
from .rms_norm import RMSNorm
from .rope import rotate_half
from .span import Linear

__all__ = ["LatentAttention", "check_latent_config", "latent_layout", "softmax_scale"]

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (DeepseekV3RMSNorm's default; not rms_norm_eps)


def latent_layout(config) -> CacheLayout:
    """A token's entry in a block: its latent, then its rotated key, one 'head' shared by all."""
    return CacheLayout((CachePart("latent and rotated key", 1, config.kv_lora_rank + config.qk_rope_head_dim),))


def check_latent_config(config) -> None:
    """ValueError for a config whose latent attention is not computed as transformers does."""
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError("latent attention expands its keys for every head: num_key_value_heads must equal "
                         "num_attention_heads, as in DeepSeek-V3's config")


def softmax_scale(config) -> float:
    """1 / sqrt(qk_nope + qk_rope), times YaRN's mscale squared where `mscale_all_dim` is set, as
    transformers' yarn_apply_mscale folds it in (the non-rotary dimensions scaled too)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = config.rope_parameters
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim", 0):
        factor, weight = params["factor"], params["mscale_all_dim"]
        mscale = 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class _Projection(nn.Module):
    """kv_b_proj: a weight [heads * (qk_nope + v), kv_lora_rank], not an nn.Linear, so never quantized."""

    def __init__(self, rank: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, rank))


class LatentAttention(nn.Module):
    """Block `layer_idx`'s attention part, named as checkpoints name it (q_proj, or q_a_proj, q_a_layernorm
    and q_b_proj with a q_lora_rank; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        self.heads, self.rank = heads, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        qk = self.nope + self.rope
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = _Projection(self.rank, heads * (self.nope + self.v_dim))
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        self.layer_idx, self.window = layer_idx, None
        self.scale, self.interleaved = softmax_scale(config), bool(config.rope_interleave)

    def compute(self, normed: torch.Tensor, attention, rows: list[int], linear: Linear,
                per_segment: Callable) -> torch.Tensor:
        """The attention part's output for a pass's rows (normed [rows..., hidden]); `attention` is the
        Llama span's pass inputs (cos/sin of every row, and per segment its batch, length, cache and
        key biases); per_segment: BlockSpan.per_segment."""
        if hasattr(self, "q_proj"):
            query = linear(self.q_proj, normed)
        else:
            query = linear(self.q_b_proj, self.q_a_layernorm(linear(self.q_a_proj, normed)))
        query = query.view(*query.shape[:-1], self.heads, self.nope + self.rope)  # [rows..., heads, qk]
        q_pass, q_rot = query.split([self.nope, self.rope], dim=-1)
        latent, k_rot = linear(self.kv_a_proj_with_mqa, normed).split([self.rank, self.rope], dim=-1)
        q_rot, k_rot = self._rotated(q_rot, k_rot[..., None, :], attention.cos, attention.sin)
        query = torch.cat((q_pass, q_rot), dim=-1)
        entry = torch.cat((self.kv_a_layernorm(latent)[..., None, :], k_rot), dim=-1)  # [rows..., 1, rank + rope]
        return linear(self.o_proj, per_segment((query, entry), attention, rows, self._attend))

    def _rotated(self, q_rot: torch.Tensor, k_rot: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Elementwise, so transformers' values, which rotates after moving heads before tokens."""
        if not self.interleaved:
            return q_rot * cos + rotate_half(q_rot) * sin, k_rot * cos + rotate_half(k_rot) * sin
        cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        return tuple(torch.cat([x[..., 0::2] * cos - x[..., 1::2] * sin, x[..., 1::2] * cos + x[..., 0::2] * sin],
                               dim=-1) for x in (q_rot, k_rot))

    def _attend(self, query: torch.Tensor, entry: torch.Tensor, inputs) -> torch.Tensor:
        """One segment: query [batch (* num_new), ..., heads, qk], entry [..., 1, rank + rope] -> [batch,
        num_new, heads * v]."""
        batch, num_new = inputs.batch, inputs.num_new
        query = query.view(batch, num_new, self.heads, -1).transpose(1, 2)  # [batch, heads, new, qk]
        entry = entry.view(batch, num_new, 1, -1).transpose(1, 2)  # [batch, 1, new, rank + rope]
        if inputs.cache is not None:
            (entry,) = inputs.cache.update(self.layer_idx, entry)  # [batch, 1, kv_length, rank + rope]
        key_bias = inputs.key_bias[None]
        if self.absorbs(num_new, entry.shape[2]):
            context = self._absorbed(query, entry, key_bias)
        else:
            context = self._expanded(query, entry, key_bias)
        return context.transpose(1, 2).reshape(batch, num_new, -1)  # [batch, new, heads * v]

    def absorbs(self, num_new: int, kv_length: int) -> bool:
        """Whether attending over the latent (absorbed) takes fewer multiply-adds than expanding it."""
        heads, rank = self.heads, self.rank
        expanded = kv_length * rank * heads * (self.nope + self.v_dim) \
            + num_new * kv_length * heads * (self.nope + self.rope + self.v_dim)
        absorbed = num_new * heads * rank * (self.nope + self.v_dim) \
            + num_new * kv_length * heads * (2 * rank + self.rope)
        return absorbed < expanded

    def _expanded(self, query: torch.Tensor, entry: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        """transformers' expand_kv and attention: [batch, heads, new, v]."""
        batch, _, kv_length, _ = entry.shape
        latent, k_rot = entry.split([self.rank, self.rope], dim=-1)
        kv = F.linear(latent, self.kv_b_proj.weight).view(batch, kv_length, self.heads, -1).transpose(1, 2)
        k_nope, value = kv.split([self.nope, self.v_dim], dim=-1)  # [batch, heads, kv_length, ...]
        key = kv.new_empty(*kv.shape[:-1], self.nope + self.rope)
        key[..., : self.nope].copy_(k_nope)
        key[..., self.nope :].copy_(k_rot.expand(-1, self.heads, -1, -1))
        return grouped_attention(query, key, value, key_bias, self.scale)

    def _absorbed(self, query: torch.Tensor, entry: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        """Every head over the latent entry itself: [batch, heads, new, v]."""
        weight = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        q_pass, q_rot = query.split([self.nope, self.rope], dim=-1)
        q_latent = torch.matmul(q_pass, weight[:, : self.nope])  # [batch, heads, new, rank]
        absorbed = torch.cat((q_latent, q_rot), dim=-1)
        context = grouped_attention(absorbed, entry, entry[..., : self.rank], key_bias, self.scale)
        return torch.matmul(context, weight[:, self.nope :].transpose(1, 2))  # [batch, heads, new, v]
