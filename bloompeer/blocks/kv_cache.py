"""The attention cache of one inference session over a span of blocks, laid out as each family says.

What a token leaves behind in a block is the family's answer (`BlockSpan.cache_layout`, a
`CacheLayout`): keys and values per key/value head for grouped-query attention (BLOOM, the Llama
family), or multi-head latent attention's one compressed latent and one rotated key, shared by every
head (DeepSeek-V3: 512 + 64 values a token where 128 heads' keys and values would be 32768). The rest
of bloompeer takes that answer: its bytes size the cache budget and the room a server announces, and
everything below (append, rollback, beam reordering) works on any layout.

A session's cache is allocated whole when it opens, for its declared batch and max_length, so a
server knows its memory use up front and never runs out halfway through a generation; a step writes
its tokens in place, so no step copies the past. Every layout is positional: token i's entries sit at
index i, so rolling k tokens back (a speculative step's rejected tokens, a failed step) is only
writing the next step at an earlier position, and the entries past it are never read again. The
entries never leave the server: a client replays its inputs to rebuild them (on any server, whatever
its layout).

A recurrent block (Gated DeltaNet) answers a `RecurrentLayout` instead: what it keeps is a fixed state
per session, whatever its length. The cache holds those blocks' `RecurrentState` (`recurrent`), which
steps, rolls back within its last pass and reorders with the rest; its bytes are a cost per session
(`nbytes_per_session`), not per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .recurrent_state import RecurrentLayout, RecurrentState

__all__ = ["CacheLayout", "CachePart", "Layout", "SessionCache", "token_positions"]


def token_positions(padding_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position [batch, length] from a [batch, length] bool mask (False at padding): the
    count of real tokens before it, 0 at padding, as transformers' generate derives position ids."""
    return (padding_mask.long().cumsum(-1) - 1).masked_fill(~padding_mask, 0)


@dataclass(frozen=True)
class CachePart:
    """One tensor a block keeps per token: `heads` vectors of `width` values."""

    name: str
    heads: int
    width: int


@dataclass(frozen=True)
class CacheLayout:
    """What one block keeps per token of a session, in the order its attention's `update` passes them."""

    parts: tuple[CachePart, ...]

    @classmethod
    def keys_and_values(cls, kv_heads: int, head_dim: int) -> CacheLayout:
        """Grouped-query (or multi-head) attention's: a key and a value per key/value head."""
        return cls((CachePart("keys", kv_heads, head_dim), CachePart("values", kv_heads, head_dim)))

    @property
    def values_per_token(self) -> int:
        return sum(part.heads * part.width for part in self.parts)

    def nbytes_per_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token * torch.empty((), dtype=dtype).element_size()


Layout = CacheLayout | RecurrentLayout  # a block's answer: what it keeps per token, or per session


def _per_token(layouts: Sequence[Layout]) -> list[CacheLayout]:
    return [layout for layout in layouts if isinstance(layout, CacheLayout)]


def _recurrent(layouts: Sequence[Layout]) -> list[RecurrentLayout]:
    return [layout for layout in layouts if isinstance(layout, RecurrentLayout)]


class SessionCache:
    """The cached entries and the padding mask for blocks [start, end) of one session.

    `layouts[i]` is block start + i's layout (a recurrent block's state is in `recurrent`). A family's
    attention calls `update(layer_idx, *new)` once per block with the new tokens' entries, one tensor per
    part of its layout; `begin_step` says where in the sequence they go. Blocks of one layout share one tensor per part, [block, batch, heads,
    position, width] (the layout BLOOM's and the Llama family's keys and values have always had).
    """

    def __init__(self, layouts: Sequence[CacheLayout], start: int, end: int, batch: int, max_length: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if len(layouts) != end - start:
            raise ValueError(f"{len(layouts)} cache layouts for blocks {start}:{end}")
        self.start, self.end, self.batch, self.max_length = start, end, batch, max_length
        self.layouts = tuple(layouts)
        # one stack of tensors per distinct layout; each block's entries are views into its layout's stack
        stacks = {layout: tuple(torch.zeros(self.layouts.count(layout), batch, part.heads, max_length, part.width,
                                            dtype=dtype, device=device) for part in layout.parts)
                  for layout in dict.fromkeys(_per_token(self.layouts))}
        self._stacks = list(stacks.values())
        seen = {layout: 0 for layout in stacks}
        self._blocks: list[tuple[torch.Tensor, ...] | None] = []
        for layout in self.layouts:
            self._blocks.append(tuple(stack[seen[layout]] for stack in stacks[layout]) if layout in stacks else None)
            seen[layout] = seen.get(layout, 0) + 1
        self.recurrent = _recurrent_state(self.layouts, start, batch, dtype, device)
        self.padding_mask = torch.ones(batch, max_length, dtype=torch.bool, device=device)  # False at padding
        self.length = 0  # tokens cached so far
        # dynamic rope's longest sequence so far (0: none yet), on the device (blocks/rope.py)
        self.rope_length = torch.zeros((), dtype=torch.long, device=device)
        self._write_at = 0

    @property
    def keys(self) -> torch.Tensor:
        """The keys of a span whose blocks all cache keys and values: [block, batch, kv head, position, head_dim]."""
        return self._stacks[0][0]

    @property
    def values(self) -> torch.Tensor:
        return self._stacks[0][1]

    @staticmethod
    def nbytes(layouts: Sequence[Layout], batch: int, max_length: int, dtype: torch.dtype) -> int:
        """What a cache of these blocks' layouts takes: every block's entries, the padding mask once, and the
        recurrent blocks' state."""
        return batch * max_length * SessionCache.nbytes_per_token(layouts, dtype) \
            + SessionCache.nbytes_per_session(layouts, batch, dtype)

    @staticmethod
    def nbytes_per_token(layouts: Sequence[Layout], dtype: torch.dtype) -> int:
        """What a token of one row takes: its entries in the per-token blocks and its byte of padding mask."""
        return sum(layout.nbytes_per_token(dtype) for layout in _per_token(layouts)) + 1

    @staticmethod
    def nbytes_per_session(layouts: Sequence[Layout], batch: int, dtype: torch.dtype) -> int:
        """What a session of `batch` rows takes whatever its length: its recurrent blocks' state."""
        recurrent = _recurrent(layouts)
        return RecurrentState.nbytes(recurrent[0], len(recurrent), batch, dtype) if recurrent else 0

    def begin_step(self, position: int, padding_mask: torch.Tensor | None, num_new: int) -> torch.Tensor:
        """Place the next `num_new` tokens at `position` (<= length: a rewind drops the rest).

        Returns the padding mask of everything the step attends to: [batch, position + num_new].
        """
        if self.recurrent is not None:  # first: a rewind it cannot make (RewindError) changes nothing
            self.recurrent.begin_step(position, num_new)
        end = position + num_new
        self._write_at = position
        self.padding_mask[:, position:end] = True if padding_mask is None else padding_mask
        self.length = end
        return self.padding_mask[:, :end]

    def restore_length(self, length: int) -> None:
        """After a pass that failed: the session is again `length` tokens long, so that the same step can
        be sent again (a recurrent block's pass never writes over the state it starts from)."""
        self.length = length
        if self.recurrent is not None:
            self.recurrent.length = length

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Beam search: row i of the batch continues from row hypo_ids[i]."""
        for stack in self._stacks:
            for tensor in stack:
                tensor[:, :, :, : self.length] = tensor[:, hypo_ids, :, : self.length]
        self.padding_mask[:, : self.length] = self.padding_mask[hypo_ids, : self.length]
        if self.recurrent is not None:
            self.recurrent.reorder(hypo_ids)

    def update(self, layer_idx: int, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store the new tokens' entries of block `layer_idx`, one [batch, heads, new, width] per part of its
        layout; return views of all its entries so far ([batch, heads, kv_length, width] each)."""
        entries = self._blocks[layer_idx - self.start]
        end = self._write_at + new[0].shape[2]
        for stored, part in zip(entries, new, strict=True):
            stored[:, :, self._write_at : end] = part
        return tuple(stored[:, :, :end] for stored in entries)

    def update_at(self, layer_idx: int, index: torch.Tensor, length: int, *new: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
        """A static step's `update` (step_graphs.py): one new token's entries written at cache index `index`
        (a [1] long tensor, so that the same kernels serve every position below `length`); returns the block's
        first `length` entries ([batch, heads, length, width] each), which the step's mask limits."""
        entries = self._blocks[layer_idx - self.start]
        for stored, part in zip(entries, new, strict=True):
            stored.index_copy_(2, index, part)
        return tuple(stored[:, :, :length] for stored in entries)


def _recurrent_state(layouts: tuple[Layout, ...], start: int, batch: int, dtype: torch.dtype,
                     device: torch.device | str) -> RecurrentState | None:
    """The state of the recurrent blocks among `layouts` (blocks start...), None if there are none."""
    indices = [start + i for i, layout in enumerate(layouts) if isinstance(layout, RecurrentLayout)]
    if not indices:
        return None
    if len(set(_recurrent(layouts))) > 1:
        raise ValueError("the recurrent blocks of a span have different layouts")
    return RecurrentState(layouts[indices[0] - start], indices, batch, dtype, device)
