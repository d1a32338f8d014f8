"""An inference session across the whole chain: one server-side cache per span, one position.

The client sends each step's hidden states along the route, span by span; the servers keep
the attention caches. `position` is the number of tokens cached so far on every span.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from hivemind.p2p import P2P

from .config import ClientConfig
from .span_session import SpanInferenceSession
from .swarm import SwarmView

__all__ = ["InferenceSession"]

logger = logging.getLogger(__name__)


class InferenceSession:
    def __init__(self, p2p: P2P, swarm: SwarmView, config: ClientConfig, max_length: int):
        self.p2p, self.swarm, self.config, self.max_length = p2p, swarm, config, max_length
        self.position = 0
        self.batch: int | None = None
        self._spans: list[SpanInferenceSession] = []
        self._closed = False

    async def _open(self, batch: int) -> None:
        route = await self.swarm.route(self.config.missing_blocks_timeout_s, self.config.poll_period_s)
        opening = [SpanInferenceSession.open(self.p2p, span, self.swarm.model_uid, batch, self.max_length,
                                             self.config.request_timeout_s, self.config.alloc_timeout_s)
                   for span in route]
        results = await asyncio.gather(*opening, return_exceptions=True)
        self._spans = [result for result in results if isinstance(result, SpanInferenceSession)]
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            await self.close()
            raise failures[0]
        self.batch = batch

    async def step(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None,
                   hypo_ids: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [batch, new, hidden_size] after the embeddings -> the last block's output.

        padding_mask: [batch, new] bool, False at padding. hypo_ids: [batch] beam reordering of
        the rows cached so far.
        """
        if self._closed:
            raise RuntimeError("this inference session is closed")
        num_new = hidden.shape[1]
        if self.position + num_new > self.max_length:
            raise ValueError(f"the session was opened for max_length={self.max_length}; "
                             f"{self.position} + {num_new} tokens do not fit")
        if self.batch is None:
            await self._open(hidden.shape[0])
        elif hidden.shape[0] != self.batch:
            raise ValueError(f"the session was opened for batch {self.batch}, got {hidden.shape[0]} rows")
        for span in self._spans:
            hidden = await span.step(self.position, hidden, padding_mask, hypo_ids)
        self.position += num_new
        return hidden

    def rewind(self, position: int) -> None:
        """Forget tokens after `position`: the next step overwrites them on every server."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to {position}: {self.position} tokens are cached")
        self.position = position

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(span.close() for span in self._spans), return_exceptions=True)
