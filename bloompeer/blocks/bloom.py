"""The BLOOM family: its blocks as a checkpoint names them (`h.{i}.*`), and how a span of them computes.

A block as transformers' BloomBlock computes it, op for op (same kernels, same order, so one request
alone gives transformers' values to the bit, which tests/unit/test_blocks.py checks): ALiBi from the
padding mask, fused QKV, BLOOM's tanh GELU. Why not transformers' own BloomBlock: importing
`transformers.models.bloom.modeling_bloom` pulls in `modeling_utils`, and with it torch._dynamo,
torch.distributed and generation: seconds of CPU in every server process, for a class of which a
server uses only the parameters.

The client keeps the word embeddings, their layernorm and the final layernorm; the LM head is tied
to the embeddings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BloomConfig

from .family import ClientParts, ModelFamily
from .kv_cache import CacheLayout
from .span import BlockSpan, Linear, Segment

__all__ = ["BLOOM", "BloomSpan", "alibi_bias", "bloom_gelu"]

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

    def compute(self, hidden: torch.Tensor, linear: Linear, rows: list[int] | None = None) -> torch.Tensor:
        """hidden [rows..., hidden] (normed) -> [rows..., hidden], before the residual."""
        return linear(self.dense_4h_to_h, bloom_gelu(linear(self.dense_h_to_4h, hidden)))


class BloomBlock(nn.Module):
    """The parameters of BLOOM block `layer_idx`, named as in a checkpoint; BloomSpan computes with them."""

    def __init__(self, config: BloomConfig, layer_idx: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attention = _Attention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = _Mlp(config)


class _AttentionInputs:
    """Per-segment attention inputs that are the same for every block: ALiBi bias and mask."""

    def __init__(self, segment: Segment, num_heads: int):
        batch, num_new, _ = segment.hidden.shape
        dtype, mask = segment.hidden.dtype, segment.full_padding_mask
        self.batch, self.num_new, self.cache = batch, num_new, segment.cache
        self.alibi = alibi_bias(mask.long(), num_heads, dtype)  # [batch * heads, 1, kv_length]
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        # blocked entries hold the dtype's minimum rather than -inf, as in transformers' eager mask
        self.bias = torch.where(segment.allowed_keys(), zero, torch.finfo(dtype).min)  # [batch, 1, new, kv]


class BloomSpan(BlockSpan):
    """Blocks [start, end) of a BLOOM model."""

    @classmethod
    def check_config(cls, config: BloomConfig) -> None:
        if config.pretraining_tp > 1 and config.slow_but_exact:
            raise ValueError("BLOOM configs with slow_but_exact=True are not supported")

    def make_block(self, config: BloomConfig, layer_idx: int) -> nn.Module:
        return BloomBlock(config, layer_idx)

    @property
    def num_heads(self) -> int:
        return self.config.n_head

    @classmethod
    def cache_layout(cls, config: BloomConfig, layer_idx: int) -> CacheLayout:
        return CacheLayout.keys_and_values(config.n_head, config.hidden_size // config.n_head)

    @property
    def head_dim(self) -> int:
        return self.config.hidden_size // self.config.n_head

    def attention_inputs(self, segment: Segment) -> _AttentionInputs:
        return _AttentionInputs(segment, self.num_heads)

    def block_forward(self, block: BloomBlock, hidden: torch.Tensor, attention: list[_AttentionInputs],
                      rows: list[int], linear: Linear) -> torch.Tensor:
        """BloomBlock.forward: attention, then the MLP, each added to its residual. hidden: [rows..., hidden]."""
        post_layernorm = self.config.apply_residual_connection_post_layernorm
        layernorm_output = block.input_layernorm(hidden)
        residual = layernorm_output if post_layernorm else hidden
        attention_output = residual + self.attention(block.self_attention, layernorm_output, attention, rows, linear)
        layernorm_output = block.post_attention_layernorm(attention_output)
        residual = layernorm_output if post_layernorm else attention_output
        return residual + block.mlp.compute(layernorm_output, linear, rows)

    def attention(self, attn: _Attention, normed: torch.Tensor, attention: list[_AttentionInputs], rows: list[int],
                  linear: Linear) -> torch.Tensor:
        """The attention part's output (before the residual), segment by segment."""
        fused_qkv = linear(attn.query_key_value, normed)  # [rows..., 3 * hidden]
        context = self.per_segment((fused_qkv,), attention, rows, lambda qkv, inputs: self._attend(attn, qkv, inputs))
        return linear(attn.dense, context)

    def _attend(self, attn, fused_qkv: torch.Tensor, segment: _AttentionInputs) -> torch.Tensor:
        """BloomAttention's core for one segment: [batch * num_new, 3 * hidden] -> [batch, num_new, hidden]."""
        batch, num_new, heads, head_dim = segment.batch, segment.num_new, self.num_heads, self.head_dim
        fused_qkv = fused_qkv.view(batch, num_new, heads, 3, head_dim)
        query = fused_qkv[..., 0, :].transpose(1, 2)  # [batch, heads, num_new, head_dim]
        key = fused_qkv[..., 1, :].transpose(1, 2)
        value = fused_qkv[..., 2, :].transpose(1, 2)
        if segment.cache is not None:
            key, value = segment.cache.update(attn.layer_idx, key, value)  # [batch, heads, kv_length, head_dim]
        query = query.reshape(batch * heads, -1, head_dim)
        key = key.reshape(batch * heads, -1, head_dim).transpose(-1, -2)
        value = value.reshape(batch * heads, -1, head_dim)
        scores = segment.alibi.baddbmm(batch1=query, batch2=key, beta=attn.beta, alpha=attn.inv_norm_factor)
        weights = scores.view(batch, heads, num_new, -1) + segment.bias
        probs = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        context = torch.bmm(probs.view(batch * heads, num_new, -1), value)  # [batch * heads, num_new, head_dim]
        context = context.view(batch, heads, num_new, head_dim).permute(0, 2, 1, 3)
        return context.reshape(batch, num_new, heads * head_dim)


def _client_modules(config: BloomConfig) -> dict[str, nn.Module]:
    """BloomModel's modules around its blocks."""
    hidden, eps = config.hidden_size, config.layer_norm_epsilon
    return {"word_embeddings": nn.Embedding(config.vocab_size, hidden),
            "word_embeddings_layernorm": nn.LayerNorm(hidden, eps=eps), "ln_f": nn.LayerNorm(hidden, eps=eps)}


BLOOM = ModelFamily(
    name="bloom",
    config_classes={"bloom": "BloomConfig"},
    span_class=BloomSpan,
    block_prefix_format="h.{}.",
    stored_prefix="transformer.",  # BloomForCausalLM's checkpoints prefix every name with it, BloomModel's do not
    client=ClientParts(class_name="Bloom", pretrained_model="BloomPreTrainedModel", tensor_prefix="",
                       embeddings="word_embeddings", embedding_norm="word_embeddings_layernorm", final_norm="ln_f",
                       make_modules=_client_modules),
)
