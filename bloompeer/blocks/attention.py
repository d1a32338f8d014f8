"""Attention over a session's cache, as the Llama family's variants compute it: grouped-query attention
through PyTorch's fused kernel, and gpt-oss's with learned sinks, written out as transformers' eager one.

Grouped-query attention never copies the keys and values: each key/value head's query heads are folded
into its query rows, as transformers folds them for one-token steps; each row is computed alone either
way, so no single dot product changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["as_key_bias", "attention_with_sinks", "grouped_attention"]


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_bias: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Attention of query [batch, heads, new, head_dim] over key [batch, kv_heads, kv_length, head_dim]
    and value [batch, kv_heads, kv_length, value_dim] (views of the cache), key_bias [batch, 1, new,
    kv_length] (see `as_key_bias`): [batch, heads, new, value_dim].

    Query head h uses key/value head h // (heads / kv_heads). Rather than repeating each key/value
    head for its query heads (a copy of the whole past per step), a key/value head's query heads
    become more query rows of that head; each row's attention is computed alone either way."""
    batch, heads, num_new, head_dim = query.shape
    repeats = heads // key.shape[1]
    if repeats > 1:
        query = query.reshape(batch, key.shape[1], repeats * num_new, head_dim)
        if num_new > 1:
            key_bias = key_bias[:, :, None].expand(-1, -1, repeats, -1, -1).reshape(batch, 1, repeats * num_new, -1)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=key_bias, scale=scale)
    return output.reshape(batch, heads, num_new, value.shape[-1])  # values may be narrower (MLA's)


def attention_with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_bias: torch.Tensor,
                         scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """gpt-oss's attention, as transformers' eager one computes it: each head's scores with one more
    logit, its learned sink, softmaxed together (less the row's max), the sink's share then dropped.
    Shapes as grouped_attention's; query heads are folded into their key/value head's rows likewise
    (no copy of the past), which changes no single dot product."""
    batch, heads, num_new, head_dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    if key.shape[2] == num_new:  # no cache: the keys are this step's own, laid out as transformers' repeat_kv
        key = key.contiguous()  # lays them out (the product's bits follow the layout); no past is copied
    folded = query.reshape(batch, kv_heads, heads // kv_heads * num_new, head_dim)
    scores = torch.matmul(folded, key.transpose(2, 3)).view(batch, heads, num_new, kv_length) * scale + key_bias
    combined = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(batch, -1, num_new, -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(value.dtype)
    output = torch.matmul(probs.reshape(batch, kv_heads, -1, kv_length), value)
    return output.view(batch, heads, num_new, head_dim)


def as_key_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask that attention gets for a bool one: 0 where a query sees a key, -inf where not.
    PyTorch's attention turns a bool mask into exactly this on every call (transformers passes it bool),
    so making it once per pass gives the same values and saves that conversion per block and segment."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
