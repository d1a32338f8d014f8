"""Full forwards and backwards through every block (no cache kept), span by span, routing around
failures; and the autograd Function that makes the remote blocks part of a torch graph.

The input of each span is known when it is sent, so a span that fails is simply routed again (its
server banned for a while) and the same input is sent to the new route. The forward records what
each span received; the backward sends it back with the output gradient, in reverse order. When a
span fails during the backward, its blocks are routed again, the forward is recomputed through the
new pieces to get their inputs, and the backward goes through them instead. A batch too large for
one request travels as several.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ...p2p import P2P, RemoteError
from .config import ClientConfig
from .retry import Refusals, on_a_route
from .routing import RequestSize, RoutePlan, SpanRoute
from .span_session import remote_backward, remote_forward
from .swarm import SwarmView

__all__ = ["SwarmSequential", "ThroughSwarm"]

T = TypeVar("T")


@dataclass(frozen=True)
class _Piece:
    """One span of a forward: where it ran and what it received (kept for the backward)."""

    route: SpanRoute
    hidden: torch.Tensor


class SwarmSequential:
    """Forward and backward of whole sequences through blocks of the swarm (async; client loop).

    Nothing is cached on the servers, so each span's request stands alone: a failed one is sent
    again elsewhere, with no replay.
    """

    def __init__(self, p2p: P2P, swarm: SwarmView, config: ClientConfig):
        self.p2p, self.swarm, self.config = p2p, swarm, config

    async def forward(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None,
                      prompts: torch.Tensor | None = None, start: int = 0,
                      end: int | None = None, failed: RemoteError | None = None) -> tuple[torch.Tensor, list[_Piece]]:
        """hidden entering block `start` -> hidden leaving block `end` - 1, and the pieces it went through.

        prompts: [num_model_blocks, batch, prompt_length, hidden] deep prompts, or None.
        failed: the failure of the server that had these blocks before (a backward's recovery).
        """
        end = self.swarm.num_model_blocks if end is None else end
        pieces: list[_Piece] = []
        refusals: Refusals = {}
        while start < end:
            async def run(piece: SpanRoute) -> torch.Tensor:
                return await remote_forward(self.p2p, piece, self.swarm.model_uid, hidden, padding_mask,
                                            self.config.request_timeout_s, piece.blocks_of(prompts),
                                            self.config.wire_codec)

            size = RequestSize(hidden.shape[0], hidden.shape[1], hidden.shape[:2].numel())
            piece, output = await self._first_piece(start, end, run, size, refusals, failed)
            pieces.append(_Piece(piece, hidden))
            hidden, start, failed = output, piece.end, None
        return hidden, pieces

    async def backward(self, pieces: list[_Piece], grad_output: torch.Tensor, padding_mask: torch.Tensor | None,
                       prompts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of the first piece's input, and of the deep prompts, for the last piece's output gradient."""
        grad_prompts = None if prompts is None else torch.zeros_like(prompts)
        for piece in reversed(pieces):
            grad_output = await self._backward_piece(piece, grad_output, padding_mask, prompts, grad_prompts)
        return grad_output, grad_prompts

    async def _backward_piece(self, piece: _Piece, grad_output: torch.Tensor, padding_mask: torch.Tensor | None,
                              prompts: torch.Tensor | None, grad_prompts: torch.Tensor | None) -> torch.Tensor:
        try:
            grad_hidden, piece_grad_prompts = await remote_backward(
                self.p2p, piece.route, self.swarm.model_uid, piece.hidden, grad_output, padding_mask,
                self.config.request_timeout_s, piece.route.blocks_of(prompts), self.config.wire_codec)
        except RemoteError as exc:
            # the blocks of the failed piece, on new servers: their inputs first, then back through them
            _, pieces = await self.forward(piece.hidden, padding_mask, prompts, piece.route.start, piece.route.end,
                                           failed=exc)
            for new_piece in reversed(pieces):
                grad_output = await self._backward_piece(new_piece, grad_output, padding_mask, prompts, grad_prompts)
            return grad_output
        if piece_grad_prompts is not None:
            grad_prompts[piece.route.start:piece.route.end] += piece_grad_prompts
        return grad_hidden

    async def _first_piece(self, start: int, end: int, run: Callable[[SpanRoute], Awaitable[T]],
                           size: RequestSize, refusals: Refusals,
                           failed: RemoteError | None = None) -> tuple[SpanRoute, T]:
        """Run the first piece of the best route through [start, end), routed again on failures (retry.py)."""

        async def attempt(plan: RoutePlan) -> tuple[SpanRoute, T]:
            return plan.route[0], await run(plan.route[0])

        return await on_a_route(self.swarm, start, end, attempt, size, refusals,
                                wait_s=self.config.missing_blocks_timeout_s, recovery_s=self.config.recovery_timeout_s,
                                poll_period_s=self.config.poll_period_s, failed=failed)


def _batch_chunks(batch: int, length: int, max_rows: int) -> list[slice]:
    """Slices of the batch with at most max_rows rows (batch x length) each (one sequence at least)."""
    per_chunk = max(1, max_rows // max(1, length))
    return [slice(begin, min(batch, begin + per_chunk)) for begin in range(0, batch, per_chunk)]


def _rows(tensor: torch.Tensor | None, chunk: slice, batch_dim: int = 0) -> torch.Tensor | None:
    if tensor is None:
        return None
    return tensor[chunk] if batch_dim == 0 else tensor[:, chunk]


class ThroughSwarm(torch.autograd.Function):
    """The swarm's blocks as one differentiable function of the hidden states and deep prompts.

    A batch larger than the client's max_rows_per_request travels as several requests (of whole
    sequences), forward and backward alike.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, prompts: torch.Tensor | None, run, padding_mask) -> torch.Tensor:
        """run: (SwarmSequential, a callable that runs a coroutine on the client's loop)."""
        sequential, runtime_run = run
        prompts = None if prompts is None else prompts.detach()
        chunks = _batch_chunks(hidden.shape[0], hidden.shape[1], sequential.config.max_rows_per_request)
        outputs, ctx.pieces = [], []
        for chunk in chunks:
            output, pieces = runtime_run(sequential.forward(hidden.detach()[chunk], _rows(padding_mask, chunk),
                                                            _rows(prompts, chunk, batch_dim=1)))
            outputs.append(output)
            ctx.pieces.append(pieces)
        ctx.run, ctx.chunks, ctx.padding_mask, ctx.prompts = run, chunks, padding_mask, prompts
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        sequential, runtime_run = ctx.run
        grads_hidden, grads_prompts = [], []
        for chunk, pieces in zip(ctx.chunks, ctx.pieces):
            grad_hidden, grad_prompts = runtime_run(sequential.backward(
                pieces, grad_output[chunk].contiguous(), _rows(ctx.padding_mask, chunk),
                _rows(ctx.prompts, chunk, batch_dim=1)))
            grads_hidden.append(grad_hidden)
            grads_prompts.append(grad_prompts)
        grad_prompts = None if ctx.prompts is None else torch.cat(grads_prompts, dim=1)
        return torch.cat(grads_hidden), grad_prompts, None, None
