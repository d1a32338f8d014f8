"""What generate() sees as the model's cache: the position of a remote inference session.

transformers (5.x) passes a `Cache` to every forward during generation and slices the input
ids by its length. The keys and values live on the servers; this object only reports how many
tokens they hold, and carries beam search's reordering to the next step. Trained prompts sit in
the session before the text; the cache counts only the text's tokens, as generate() expects.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .inference_session import InferenceSession

__all__ = ["RemoteCache"]


class _RemotePositionLayer(CacheLayerMixin):
    supports_early_init = False
    is_croppable = True  # a rewind: the servers' next step overwrites the dropped tokens in place

    def __init__(self, session: InferenceSession, prefix_length: int):
        super().__init__()
        self.session, self.prefix_length = session, prefix_length
        self.pending_hypo_ids: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a RemoteCache holds no tensors: the servers do")

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("a RemoteCache holds no tensors: the servers do")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return max(0, self.session.position - self.prefix_length)

    def get_max_length(self) -> int:
        return self.session.max_length - self.prefix_length

    def reset(self) -> None:
        self.session.rewind(0)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.session.rewind(max(self.prefix_length, self.session.position + tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        beam_idx, previous = beam_idx.to("cpu", torch.int64), self.pending_hypo_ids
        self.pending_hypo_ids = beam_idx if previous is None else previous[beam_idx]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("expanding a remote session's batch is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("shrinking a remote session's batch is not supported")


class RemoteCache(Cache):
    def __init__(self, session: InferenceSession, prefix_length: int = 0):
        self._layer = _RemotePositionLayer(session, prefix_length)
        super().__init__(layers=[self._layer])

    @property
    def session(self) -> InferenceSession:
        return self._layer.session

    def take_hypo_ids(self) -> torch.Tensor | None:
        """Beam reordering to send with the next step (None if the rows stay in place)."""
        hypo_ids, self._layer.pending_hypo_ids = self._layer.pending_hypo_ids, None
        return hypo_ids
