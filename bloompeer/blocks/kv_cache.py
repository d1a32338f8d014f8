"""The attention (KV) cache of one inference session over a span of blocks, for every model family.

It is allocated whole when the session opens, for its declared batch and max_length, so a
server knows its memory use up front and never runs out halfway through a generation; a step
writes its tokens in place, so no step copies the past. A token takes 2 x kv_heads x head_dim
values per block: the key/value heads, which grouped-query attention (the Llama family) has fewer
of than query heads. The keys and values never leave the server: a client replays its inputs to
rebuild them.
"""

from __future__ import annotations

import torch

__all__ = ["SessionCache", "token_positions"]


def token_positions(padding_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position [batch, length] from a [batch, length] bool mask (False at padding): the
    count of real tokens before it, 0 at padding, as transformers' generate derives position ids."""
    return (padding_mask.long().cumsum(-1) - 1).masked_fill(~padding_mask, 0)


class SessionCache:
    """Keys, values and the padding mask for blocks [start, end) of one session.

    A family's attention calls `update(key, value, layer_idx)` once per block with the new tokens'
    keys and values; `begin_step` says where in the sequence they go.
    """

    def __init__(self, kv_heads: int, head_dim: int, start: int, end: int, batch: int, max_length: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (end - start, batch, kv_heads, max_length, head_dim)  # [block, batch, kv head, position, head_dim]
        self.start, self.end, self.batch, self.max_length = start, end, batch, max_length
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.padding_mask = torch.ones(batch, max_length, dtype=torch.bool, device=device)  # False at padding
        self.length = 0  # tokens cached so far
        self.rope_length: int | None = None  # dynamic rope's longest sequence so far (see blocks/rope.py)
        self._write_at = 0

    @staticmethod
    def nbytes(kv_heads: int, head_dim: int, num_blocks: int, batch: int, max_length: int,
               dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_blocks * batch * max_length * kv_heads * head_dim * element_size + batch * max_length

    def begin_step(self, position: int, padding_mask: torch.Tensor | None, num_new: int) -> torch.Tensor:
        """Place the next `num_new` tokens at `position` (<= length: a rewind drops the rest).

        Returns the padding mask of everything the step attends to: [batch, position + num_new].
        """
        end = position + num_new
        self._write_at = position
        self.padding_mask[:, position:end] = True if padding_mask is None else padding_mask
        self.length = end
        return self.padding_mask[:, :end]

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Beam search: row i of the batch continues from row hypo_ids[i]."""
        self.keys[:, :, :, : self.length] = self.keys[:, hypo_ids, :, : self.length]
        self.values[:, :, :, : self.length] = self.values[:, hypo_ids, :, : self.length]
        self.padding_mask[:, : self.length] = self.padding_mask[hypo_ids, : self.length]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [batch, kv heads, new, head_dim]; return views of all keys/values so far."""
        block, end = layer_idx - self.start, self._write_at + key.shape[2]
        self.keys[block, :, :, self._write_at : end] = key
        self.values[block, :, :, self._write_at : end] = value
        return self.keys[block, :, :, :end], self.values[block, :, :, :end]
