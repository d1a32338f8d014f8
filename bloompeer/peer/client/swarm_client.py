"""A client's connection to the swarm for one model: network, swarm view and the calls models use.

Its methods are synchronous: they run on the client's event loop thread (see runtime.py), so
a torch model can call them from its forward.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from ...p2p import PeerNode
from .config import ClientConfig
from .inference_session import InferenceSession
from .runtime import ClientRuntime
from .sequential import forward_through_swarm
from .swarm import SwarmView

__all__ = ["SwarmClient"]

logger = logging.getLogger(__name__)


class SwarmClient:
    def __init__(self, runtime: ClientRuntime, node: PeerNode, swarm: SwarmView, config: ClientConfig):
        self.runtime, self.node, self.swarm, self.config = runtime, node, swarm, config
        self._refresher = runtime.run(self._start_refresher())

    async def _start_refresher(self) -> asyncio.Task:
        return asyncio.create_task(self.swarm.keep_fresh(), name="bloompeer-swarm-view")

    @classmethod
    def connect(cls, model_uid: str, num_blocks: int, fingerprint: str | None, config: ClientConfig) -> SwarmClient:
        runtime = ClientRuntime()
        try:
            node = runtime.run(PeerNode.create(config.network))
        except BaseException:
            runtime.shutdown()
            raise
        view = SwarmView(node.p2p, node.directory, model_uid, num_blocks, fingerprint, config.swarm_refresh_period_s)
        return cls(runtime, node, view, config)

    def open_session(self, max_length: int) -> InferenceSession:
        """A session whose servers are chosen, and caches reserved, at its first step."""
        return InferenceSession(self.node.p2p, self.swarm, self.config, max_length)

    def step(self, session: InferenceSession, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None,
             hypo_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.runtime.run(session.step(hidden, padding_mask, hypo_ids))

    def close_session(self, session: InferenceSession) -> None:
        self.runtime.run(session.close())

    def forward(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """A full forward through every block, with no cache kept on the servers."""
        return self.runtime.run(forward_through_swarm(self.node.p2p, self.swarm, self.config, hidden, padding_mask))


    def shutdown(self) -> None:
        if self.runtime is None:
            return
        try:
            self.runtime.run(self._stop())
        finally:
            self.runtime.shutdown()
            self.runtime = None

    async def _stop(self) -> None:
        self._refresher.cancel()
        await asyncio.gather(self._refresher, return_exceptions=True)
        await self.node.shutdown()
