"""A contiguous range of BLOOM blocks: what one server computes, for one request or many at once.

The weights live in layers.py's modules, named as in a checkpoint. The forward is written out
here, op for op as HF's BloomBlock computes it (same kernels, same order, so one request alone
gives bitwise HF results), because a server batches the steps of different sessions: the linear
layers, which read all the weights, run once on every session's rows together, while attention
runs per session against that session's own cache, length and padding. A span that keeps
batched linears (keep_batched_linears) computes those passes' linear layers with another kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BloomConfig

from .batched_linear import BatchedLinears
from .checkpoint import Checkpoint, block_prefix
from .kv_cache import SessionCache
from .layers import BlockLayers, alibi_bias, bloom_gelu

__all__ = ["BlockSpan", "Segment", "attention_bias"]


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


@dataclass
class Segment:
    """One request's part of a pass through the span.

    hidden: [batch, num_new, hidden_size]. padding_mask: [batch, kv_length] bool, False at
    padding, over the cached tokens and the new ones (None: no padding, no cache). cache: where
    the request's keys and values go (None for a forward that keeps nothing). prompts: [blocks
    of the pass, batch, k <= num_new, hidden] deep prompts: prompts[i] is added to the first k
    new tokens entering the pass's block i.
    """

    hidden: torch.Tensor
    padding_mask: torch.Tensor | None = None
    cache: SessionCache | None = None
    prompts: torch.Tensor | None = None

    def add_prompts(self, hidden: torch.Tensor, index: int) -> torch.Tensor:
        """hidden ([batch, num_new, hidden]) with block `index`'s prompts added (a new tensor)."""
        length = self.prompts.shape[2]
        return torch.cat([hidden[:, :length] + self.prompts[index], hidden[:, length:]], dim=1)


class _Attention:
    """Per-segment attention inputs that are the same for every block: ALiBi bias and mask."""

    def __init__(self, segment: Segment, num_heads: int):
        batch, num_new, _ = segment.hidden.shape
        dtype = segment.hidden.dtype
        mask = segment.padding_mask
        if mask is None:
            mask = torch.ones(batch, num_new, dtype=torch.bool, device=segment.hidden.device)
        self.batch, self.num_new, self.cache = batch, num_new, segment.cache
        self.alibi = alibi_bias(mask.long(), num_heads, dtype)  # [batch * heads, 1, kv_length]
        self.bias = attention_bias(mask, num_new, dtype)  # [batch, 1, num_new, kv_length]


class BlockSpan(nn.Module):
    """Blocks [start, end) of a BLOOM model."""

    def __init__(self, config: BloomConfig, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= config.n_layer:
            raise ValueError(f"blocks {start}:{end} are not a range within the model's {config.n_layer} blocks")
        if config.pretraining_tp > 1 and config.slow_but_exact:
            raise NotImplementedError("BLOOM configs with slow_but_exact=True are not supported")
        self.config, self.start, self.end = config, start, end
        self.num_heads, self.head_dim = config.n_head, config.hidden_size // config.n_head
        self.blocks = nn.ModuleList(BlockLayers(config, layer_idx=i) for i in range(start, end))
        self.batched_linears: BatchedLinears | None = None  # see keep_batched_linears

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

    def keep_batched_linears(self) -> int:
        """Keep the copy of the weights that passes of several requests compute with (see
        batched_linear.py), where it is for (float32 on the CPU); returns its size in bytes."""
        if not BatchedLinears.supported(self):
            return 0
        self.batched_linears = BatchedLinears(self)
        return self.batched_linears.nbytes

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    def forward(
        self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None, cache: SessionCache | None = None,
        start: int | None = None, end: int | None = None, prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One request through blocks [start, end) (default: the whole span); see Segment."""
        return self.forward_segments([Segment(hidden, padding_mask, cache, prompts)], start, end)[0]

    def forward_segments(
        self, segments: Sequence[Segment], start: int | None = None, end: int | None = None,
    ) -> list[torch.Tensor]:
        """Several requests through blocks [start, end) in one pass; one output per segment."""
        start, end = self.start if start is None else start, self.end if end is None else end
        attention = [_Attention(segment, self.num_heads) for segment in segments]
        rows = [segment.hidden.shape[0] * segment.hidden.shape[1] for segment in segments]
        if len(segments) == 1:
            hidden = segments[0].hidden  # [batch, num_new, hidden]: HF's own shapes, for bitwise equality
        else:
            hidden = torch.cat([segment.hidden.reshape(-1, segment.hidden.shape[-1]) for segment in segments])
        prompted = any(segment.prompts is not None for segment in segments)
        linear = _module_call
        if len(segments) > 1 and self.batched_linears is not None and sum(rows) <= self.batched_linears.max_rows:
            linear = self.batched_linears
        for index, block in enumerate(self.blocks[start - self.start : end - self.start]):
            if prompted:
                hidden = _with_prompts(hidden, segments, rows, index)
            hidden = self._block(block, hidden, attention, rows, linear)
        if len(segments) == 1:
            return [hidden]
        return [part.view_as(segment.hidden) for part, segment in zip(hidden.split(rows), segments)]

    def _block(self, block: BlockLayers, hidden: torch.Tensor, attention: list[_Attention], rows: list[int],
               linear: Callable[[nn.Linear, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """BloomBlock.forward, with attention done segment by segment. hidden: [rows..., hidden]."""
        post_layernorm = self.config.apply_residual_connection_post_layernorm
        layernorm_output = block.input_layernorm(hidden)
        residual = layernorm_output if post_layernorm else hidden
        attn = block.self_attention
        fused_qkv = linear(attn.query_key_value, layernorm_output)  # [rows..., 3 * hidden]
        if len(attention) == 1:
            context = self._attend(attn, fused_qkv, attention[0])
        else:
            context = torch.cat([self._attend(attn, part, segment).flatten(0, 1)
                                 for part, segment in zip(fused_qkv.split(rows), attention)])
        attention_output = residual + linear(attn.dense, context)
        layernorm_output = block.post_attention_layernorm(attention_output)
        residual = layernorm_output if post_layernorm else attention_output
        mlp = block.mlp
        return residual + linear(mlp.dense_4h_to_h, bloom_gelu(linear(mlp.dense_h_to_4h, layernorm_output)))

    def _attend(self, attn, fused_qkv: torch.Tensor, segment: _Attention) -> torch.Tensor:
        """BloomAttention's core for one segment: [batch * num_new, 3 * hidden] -> [batch, num_new, hidden]."""
        batch, num_new, heads, head_dim = segment.batch, segment.num_new, self.num_heads, self.head_dim
        fused_qkv = fused_qkv.view(batch, num_new, heads, 3, head_dim)
        query = fused_qkv[..., 0, :].transpose(1, 2)  # [batch, heads, num_new, head_dim]
        key = fused_qkv[..., 1, :].transpose(1, 2)
        value = fused_qkv[..., 2, :].transpose(1, 2)
        if segment.cache is not None:
            key, value = segment.cache.update(key, value, attn.layer_idx)  # [batch, heads, kv_length, head_dim]
        query = query.reshape(batch * heads, -1, head_dim)
        key = key.reshape(batch * heads, -1, head_dim).transpose(-1, -2)
        value = value.reshape(batch * heads, -1, head_dim)
        scores = segment.alibi.baddbmm(batch1=query, batch2=key, beta=attn.beta, alpha=attn.inv_norm_factor)
        weights = scores.view(batch, heads, num_new, -1) + segment.bias
        probs = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        context = torch.bmm(probs.view(batch * heads, num_new, -1), value)  # [batch * heads, num_new, head_dim]
        context = context.view(batch, heads, num_new, head_dim).permute(0, 2, 1, 3)
        return context.reshape(batch, num_new, heads * head_dim)


def _module_call(linear: nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    """The linear layer as transformers calls it (MKL through F.linear)."""
    return linear(rows)


def _with_prompts(hidden: torch.Tensor, segments: Sequence[Segment], rows: list[int], index: int) -> torch.Tensor:
    """Add block `index`'s deep prompts of every segment that has some; hidden is one segment's
    [batch, num_new, hidden], or all segments' rows flattened into [rows, hidden]."""
    if len(segments) == 1:
        return segments[0].add_prompts(hidden, index)
    parts = hidden.split(rows)
    return torch.cat([part if segment.prompts is None
                      else segment.add_prompts(part.view_as(segment.hidden), index).flatten(0, 1)
                      for part, segment in zip(parts, segments)])
