"""A full forward through every block (no cache kept), span by span, routing around failures.

The input of each span is known when it is sent, so a span that fails is simply routed again
(its server banned for a while) and the same input is sent to the new route.
"""

from __future__ import annotations

import time

import torch
from hivemind.p2p import P2P

from ...p2p import RemoteError
from .config import ClientConfig
from .errors import MissingBlocksError
from .span_session import remote_forward
from .swarm import SwarmView

__all__ = ["forward_through_swarm"]


async def forward_through_swarm(p2p: P2P, swarm: SwarmView, config: ClientConfig, hidden: torch.Tensor,
                                padding_mask: torch.Tensor | None) -> torch.Tensor:
    """hidden: [batch, length, hidden_size] after the embeddings -> the last block's output."""
    route = await swarm.route(timeout_s=config.missing_blocks_timeout_s, poll_period_s=config.poll_period_s)
    deadline, error = None, None
    while route:
        piece = route[0]
        try:
            hidden = await remote_forward(p2p, piece, swarm.model_uid, hidden, padding_mask, config.request_timeout_s)
            route = route[1:]
            continue
        except RemoteError as exc:
            swarm.bans.ban(exc.peer, str(exc))
            error = exc
        deadline = deadline or time.monotonic() + config.recovery_timeout_s
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise MissingBlocksError(swarm.model_uid, list(range(piece.start, piece.end)), config.recovery_timeout_s,
                                     str(error))
        route = await swarm.route(piece.start, swarm.num_blocks, timeout_s=remaining_s,
                                  poll_period_s=config.poll_period_s)
    return hidden
