"""A contiguous range of BLOOM blocks: what one server computes for one step.

The blocks are transformers' own BloomBlock modules, so the arithmetic is HF's; this module
adds what the full BloomModel would otherwise compute around them: the ALiBi bias from the
padding mask, and the causal mask for the new tokens against everything cached.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BloomConfig
from transformers.models.bloom.modeling_bloom import BloomBlock, build_alibi_tensor

from .checkpoint import Checkpoint, block_prefix
from .kv_cache import SessionCache

__all__ = ["BlockSpan", "attention_bias"]


def attention_bias(padding_mask: torch.Tensor, num_new: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [batch, 1, num_new, kv_length] for the last `num_new` positions.

    A query at position p sees keys at positions <= p that are not padding; as in HF's eager
    mask, blocked entries hold the dtype's minimum rather than -inf.
    """
    kv_length = padding_mask.shape[1]
    query_positions = torch.arange(kv_length - num_new, kv_length, device=padding_mask.device)
    key_positions = torch.arange(kv_length, device=padding_mask.device)
    causal = key_positions[None, :] <= query_positions[:, None]  # [num_new, kv_length]
    allowed = causal[None, None] & padding_mask[:, None, None, :]  # [batch, 1, num_new, kv_length]
    zero = torch.zeros((), dtype=dtype, device=padding_mask.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


class BlockSpan(nn.Module):
    """Blocks [start, end) of a BLOOM model."""

    def __init__(self, config: BloomConfig, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= config.n_layer:
            raise ValueError(f"blocks {start}:{end} are not a range within the model's {config.n_layer} blocks")
        self.config, self.start, self.end = config, start, end
        self.blocks = nn.ModuleList(BloomBlock(config, layer_idx=i) for i in range(start, end))

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Checkpoint, start: int, end: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> BlockSpan:
        """Build the span from the checkpoint, reading only the shards that hold its tensors."""
        config = checkpoint.config()
        with torch.device("meta"):
            span = cls(config, start, end)
        prefixes = tuple(block_prefix(i) for i in range(start, end))
        tensors = checkpoint.load_tensors(prefixes, dtype, desc=f"blocks {start}:{end}")
        state = {}
        for name, tensor in tensors.items():  # "h.{i}.{rest}" -> "blocks.{i - start}.{rest}"
            _, index, rest = name.split(".", 2)
            state[f"blocks.{int(index) - start}.{rest}"] = tensor
        span.load_state_dict(state, strict=True, assign=True)
        return span.to(device).eval().requires_grad_(False)

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    def forward(
        self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None, cache: SessionCache | None = None,
        start: int | None = None, end: int | None = None,
    ) -> torch.Tensor:
        """Run blocks [start, end) (default: all of the span). hidden: [batch, num_new, hidden_size].

        padding_mask: [batch, kv_length] bool, False at padding, covering the cached tokens and
        the new ones (kv_length = cached + num_new); None means no padding and no cache.
        """
        start, end = self.start if start is None else start, self.end if end is None else end
        batch, num_new, _ = hidden.shape
        if padding_mask is None:
            padding_mask = torch.ones(batch, num_new, dtype=torch.bool, device=hidden.device)
        alibi = build_alibi_tensor(padding_mask.long(), self.config.n_head, hidden.dtype)
        bias = attention_bias(padding_mask, num_new, hidden.dtype)
        for block in self.blocks[start - self.start : end - self.start]:
            hidden = block(hidden, alibi=alibi, attention_mask=bias, layer_past=cache, use_cache=cache is not None)[0]
        return hidden
