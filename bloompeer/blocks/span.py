"""A contiguous range of blocks: what one server computes, for one request or many at once.

This is the part every model family shares. A server batches the steps of different sessions:
the linear layers, which read all the weights, run once on every session's rows together, while
attention runs per session against that session's own cache, length and padding. So a family's
span (bloom.py, llama.py) writes out its block op for op as transformers computes it, with two
seams this loop provides: `linear(module, rows)` for every linear layer (transformers' own call for
one request alone, so that it gives transformers' values; the batched-pass kernel when several
requests share a pass; a quantized layer computes itself either way), and per-segment
attention inputs (positions, masks) computed once per pass rather than once per block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .batched_linear import BatchedLinears
from .kv_cache import Layout, SessionCache, token_positions

__all__ = ["BlockSpan", "Linear", "Segment", "allowed_keys", "float32_parameter_names"]

Linear = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (a linear layer, its input rows) -> output rows


def float32_parameter_names(block: nn.Module) -> set[str]:
    """Names (in the block's state dict) of the parameters it keeps in float32 whatever dtype it is served in:
    those a module lists in its `float32_parameters`, as transformers' `_keep_in_fp32_modules_strict` keeps them
    (DeepSeek-V3's and GLM-4.5's router weight and correction bias). The loader reads them so, and the memory
    plan counts them so."""
    return {f"{prefix}.{name}" if prefix else name for prefix, module in block.named_modules()
            for name in getattr(module, "float32_parameters", ())}


def allowed_keys(padding_mask: torch.Tensor, num_new: int, window: int | None = None,
                 query_index: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys the last `num_new` queries see (or the one query at cache index `query_index`, a [1]
    tensor: a static step's, see Segment): [batch, 1, num_new, kv_length] bool.

    A query at cache index q sees keys at indices k <= q that are not padding, and with a sliding
    window only those with k > q - window (indices, not positions: padding counts, as in transformers).
    """
    kv_length = padding_mask.shape[1]
    if query_index is None:
        query_index = torch.arange(kv_length - num_new, kv_length, device=padding_mask.device)[:, None]
    else:
        query_index = query_index.view(1, 1)
    key_index = torch.arange(kv_length, device=padding_mask.device)[None, :]
    allowed = key_index <= query_index  # [num_new, kv_length]
    if window is not None:
        allowed = allowed & (key_index > query_index - window)
    return allowed[None, None] & padding_mask[:, None, None, :]


@dataclass
class Segment:
    """One request's part of a pass through the span.

    hidden: [batch, num_new, hidden_size]. padding_mask: [batch, kv_length] bool, False at
    padding, over the cached tokens and the new ones (None: no padding, no cache). cache: where
    the request's keys and values go (None for a forward that keeps nothing). prompts: [blocks
    of the pass, batch, k <= num_new, hidden] deep prompts: prompts[i] is added to the first k
    new tokens entering the pass's block i.

    query_index: None, or a static step's (step_graphs.py: one new token per row, shapes that do not
    change from step to step, as a CUDA graph replays them): the new token's cache index as a [1] long
    tensor; padding_mask then spans a fixed length of the cache (the pass's bucket), False past the new
    token, and the cache writes at that index (StaticStepCache).
    """

    hidden: torch.Tensor
    padding_mask: torch.Tensor | None = None
    cache: SessionCache | None = None
    prompts: torch.Tensor | None = None
    query_index: torch.Tensor | None = None

    @property
    def full_padding_mask(self) -> torch.Tensor:
        """The padding mask, also where none was given: [batch, kv_length]."""
        if self.padding_mask is not None:
            return self.padding_mask
        batch, num_new, _ = self.hidden.shape
        return torch.ones(batch, num_new, dtype=torch.bool, device=self.hidden.device)

    def allowed_keys(self, window: int | None = None) -> torch.Tensor:
        """Which keys the new tokens see: [batch, 1, num_new, kv_length] bool (see `allowed_keys`)."""
        return allowed_keys(self.full_padding_mask, self.hidden.shape[1], window, self.query_index)

    def new_positions(self) -> torch.Tensor:
        """The new tokens' positions [batch, num_new] (token_positions: 0 at padding)."""
        positions = token_positions(self.full_padding_mask)
        if self.query_index is None:
            return positions[:, -self.hidden.shape[1]:]
        return positions.index_select(1, self.query_index)

    def add_prompts(self, hidden: torch.Tensor, index: int) -> torch.Tensor:
        """hidden ([batch, num_new, hidden]) with block `index`'s prompts added (a new tensor)."""
        length = self.prompts.shape[2]
        return torch.cat([hidden[:, :length] + self.prompts[index], hidden[:, length:]], dim=1)


class BlockSpan(nn.Module):
    """Blocks [start, end) of a model; a family subclasses it with its block and its attention.

    A subclass says how to build block `layer_idx` (its parameters named as the checkpoint names
    them), what a token leaves in each block's cache (`cache_layout`), what each segment's attention
    needs once per pass (`attention_inputs`), and how one block computes (`block_forward`).
    """

    def __init__(self, config, start: int, end: int):
        super().__init__()
        num_layers = config.num_hidden_layers
        if not 0 <= start < end <= num_layers:
            raise ValueError(f"blocks {start}:{end} are not a range within the model's {num_layers} blocks")
        self.check_config(config)
        self.config, self.start, self.end = config, start, end
        self.blocks = nn.ModuleList(self.make_block(config, i) for i in range(start, end))
        self.batched_linears: BatchedLinears | None = None  # see use_batched_linears

    # What a family provides

    @classmethod
    def cache_layout(cls, config, layer_idx: int) -> Layout:
        """What a session keeps in block `layer_idx` (kv_cache.py): per token (a CacheLayout) or, for a
        recurrent block, per session (a RecurrentLayout); its bytes size the cache budget, the announced room
        and every session's reservation."""
        raise NotImplementedError

    @classmethod
    def check_config(cls, config) -> None:
        """Raise ValueError if this family's code cannot compute `config` exactly."""

    def make_block(self, config, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def attention_inputs(self, segment: Segment) -> Any:
        """What every block's attention needs for this segment (masks, positions), made once per pass."""
        raise NotImplementedError

    def pass_attention(self, segments: Sequence[Segment]) -> list:
        """Every segment's attention inputs, made once per pass (a family's list may also carry what the
        pass's rows share)."""
        return [self.attention_inputs(segment) for segment in segments]

    def block_forward(self, block: nn.Module, hidden: torch.Tensor, attention: list, rows: list[int],
                      linear: Linear) -> torch.Tensor:
        """One block. hidden: one segment's [batch, num_new, hidden], or all segments' [rows, hidden]."""
        raise NotImplementedError

    @classmethod
    def experts_of(cls, config) -> tuple[tuple[int, int], ...]:
        """Per block of the model: (experts, experts a token uses) of its sparse MLP, (0, 0) for a dense
        one (what `status` and the dashboard show)."""
        return ((0, 0),) * config.num_hidden_layers

    def static_step_refusal(self, start: int, end: int, rows: int) -> str | None:
        """Why blocks [start, end) cannot take a static decode step of `rows` rows (step_graphs.py: fixed
        shapes, no host reads, as a CUDA graph replays it), or None if they can. A sparse MLP's eager pass
        groups its rows by expert into shapes the routing decides (read on the host); its static form is one
        grouped product of stacked experts, or, for experts that cannot be stacked, every expert over all the
        rows, taken only where the pass has rows enough for its reads (a module that can refuse says why
        itself: `static_refusal(rows)`). A family adds what else its blocks read on the host."""
        if any(map(any, self.experts_of(self.config)[start:end])):
            for block in self.blocks[start - self.start:end - self.start]:
                for module in block.modules():
                    reason = module.static_refusal(rows) if hasattr(module, "static_refusal") else None
                    if reason is not None:
                        return f"a mixture of experts: {reason}"
        return None

    def block_state(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A block's tensors as its checkpoint stores them (its prefix dropped) -> as its modules name them
        (gpt-oss's fused experts cut per expert, say); the same by default."""
        return tensors

    # Shared

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    def cache_layouts(self, start: int, end: int) -> list[Layout]:
        return [self.cache_layout(self.config, layer_idx) for layer_idx in range(start, end)]

    def new_cache(self, start: int, end: int, batch: int, max_length: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> SessionCache:
        return SessionCache(self.cache_layouts(start, end), start, end, batch, max_length, dtype, device)

    def cache_nbytes(self, start: int, end: int, batch: int, max_length: int, dtype: torch.dtype) -> int:
        """What a session of blocks [start, end) reserves (SessionCache.nbytes)."""
        return SessionCache.nbytes(self.cache_layouts(start, end), batch, max_length, dtype)

    def cache_costs(self, start: int, end: int, dtype: torch.dtype) -> tuple[int, int]:
        """(bytes a token of one row takes, bytes a session of one row takes whatever its length) in blocks
        [start, end): the cache budget's two rates (recurrent blocks cost per session, not per token)."""
        layouts = self.cache_layouts(start, end)
        return SessionCache.nbytes_per_token(layouts, dtype), SessionCache.nbytes_per_session(layouts, 1, dtype)

    def use_batched_linears(self) -> bool:
        """Compute the linear layers of passes of several requests with the batched-pass kernel (see
        batched_linear.py; it keeps no copy of the weights), where it serves (float32 nn.Linear on the
        CPU); whether it does."""
        if BatchedLinears.supported(self):
            self.batched_linears = BatchedLinears(self)
        return self.batched_linears is not None

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
        attention = self.pass_attention(segments)
        rows = [segment.hidden.shape[0] * segment.hidden.shape[1] for segment in segments]
        if len(segments) == 1:
            hidden = segments[0].hidden  # [batch, num_new, hidden]: transformers' own shapes, for its values
        else:
            hidden = torch.cat([segment.hidden.reshape(-1, segment.hidden.shape[-1]) for segment in segments])
        prompted = any(segment.prompts is not None for segment in segments)
        linear = _module_call
        if len(segments) > 1 and self.batched_linears is not None and sum(rows) <= self.batched_linears.max_rows:
            linear = self.batched_linears
        for index, block in enumerate(self.blocks[start - self.start : end - self.start]):
            if prompted:
                hidden = _with_prompts(hidden, segments, rows, index)
            hidden = self.block_forward(block, hidden, attention, rows, linear)
        if len(segments) == 1:
            return [hidden]
        return [part.view_as(segment.hidden) for part, segment in zip(hidden.split(rows), segments)]

    @staticmethod
    def per_segment(tensors: Sequence[torch.Tensor], attention: list, rows: list[int],
                    attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        """attend(*parts, inputs) for each segment's parts of `tensors`, joined back into one tensor:
        one segment's parts are the tensors themselves; several segments' are [rows, ...] slices, and
        their results ([batch, num_new, ...]) are flattened back to rows."""
        if len(attention) == 1:
            return attend(*tensors, attention[0])
        parts = zip(*(tensor.split(rows) for tensor in tensors))
        return torch.cat([attend(*part, inputs).flatten(0, 1) for part, inputs in zip(parts, attention)])


def _module_call(linear: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """The linear layer as transformers calls it (for float weights, MKL through F.linear)."""
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
