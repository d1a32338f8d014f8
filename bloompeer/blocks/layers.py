"""BLOOM's per-block modules and functions, numerically as transformers computes them.

Why not transformers' own BloomBlock: importing `transformers.models.bloom.modeling_bloom` pulls
in `modeling_utils`, and with it torch._dynamo, torch.distributed and generation: seconds of CPU
in every server process, on the path to a first token, for a class of which a server uses only
the parameters. These modules hold the same parameters under the same names (so a checkpoint's
`h.{i}.*` tensors load unchanged), and the functions give the same values as transformers' to the
bit, which tests/unit/test_blocks.py checks against transformers itself.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import BloomConfig

__all__ = ["BlockLayers", "alibi_bias", "bloom_gelu"]

_SQRT_2_OVER_PI = 0.79788456  # the constants of BLOOM's tanh approximation of GELU, as trained
_CUBIC = 0.044715


class _TanhGelu(torch.autograd.Function):
    """BLOOM's GELU, with the tanh approximation's own derivative (not autograd's through tanh),
    as the model was trained with."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _tanh_gelu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        tanh = torch.tanh(_SQRT_2_OVER_PI * x * (1 + _CUBIC * x * x))
        inner_derivative = _SQRT_2_OVER_PI + 3 * _SQRT_2_OVER_PI * _CUBIC * x * x
        return grad * (0.5 * x * ((1 - tanh * tanh) * inner_derivative) + 0.5 * (1 + tanh))


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.tanh(_SQRT_2_OVER_PI * x * (1 + _CUBIC * x * x)))


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """The autograd Function only where a gradient can flow: on a server's decode path its
    bookkeeping made a one-token GELU of hidden 256 take 45 to 78 us instead of 37."""
    if x.requires_grad and torch.is_grad_enabled():
        return _TanhGelu.apply(x)
    return _tanh_gelu(x)


def _alibi_slopes(num_heads: int, device: torch.device) -> torch.Tensor:
    """Per-head slopes of ALiBi (Press et al., 2021): for a power of two n, 2^(-8k/n) for head k =
    1..n; otherwise those of the largest power of two below, then every other slope of twice it."""
    def geometric(n: int, exponents: torch.Tensor) -> torch.Tensor:
        ratio = torch.full((), 2 ** (-(2 ** -(math.log2(n) - 3))), device=device, dtype=torch.float32)
        return torch.pow(ratio, exponents)

    power_of_two = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(power_of_two, torch.arange(1, 1 + power_of_two, device=device, dtype=torch.int32))
    if power_of_two == num_heads:
        return slopes
    extra = min(power_of_two, num_heads - power_of_two)
    odd = torch.arange(1, 1 + 2 * extra, 2, device=device, dtype=torch.int32)
    return torch.cat([slopes, geometric(2 * power_of_two, odd)])


def alibi_bias(padding_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi's additive attention bias, [batch * heads, 1, kv_length], from a [batch, kv_length] 0/1
    mask: a head's slope times each key's position among the non-padding keys (0 at padding).
    Constant per key, so one row serves every query (softmax ignores a per-query constant)."""
    batch, kv_length = padding_mask.shape
    positions = ((padding_mask.cumsum(dim=-1) - 1) * padding_mask)[:, None, :]
    bias = _alibi_slopes(num_heads, padding_mask.device)[..., None] * positions
    return bias.reshape(batch * num_heads, 1, kv_length).to(dtype)


class _Attention(nn.Module):
    def __init__(self, config: BloomConfig, layer_idx: int):
        super().__init__()
        hidden = config.hidden_size
        self.query_key_value = nn.Linear(hidden, 3 * hidden, bias=True)
        self.dense = nn.Linear(hidden, hidden)
        self.layer_idx = layer_idx
        self.inv_norm_factor = 1.0 / math.sqrt(hidden // config.n_head)
        self.beta = 1.0


class _Mlp(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size)


class BlockLayers(nn.Module):
    """The parameters of BLOOM block `layer_idx`, named as in a checkpoint; span.py computes with them."""

    def __init__(self, config: BloomConfig, layer_idx: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attention = _Attention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = _Mlp(config)
