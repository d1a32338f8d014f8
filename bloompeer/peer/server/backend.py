"""The blocks a server holds, and the checked computations it runs on them for its peers.

Stream handlers decode frames; this module checks that a request fits the model and the
session (shapes, ranges, positions) and runs it on the compute thread.
"""

from __future__ import annotations

import torch

from ...blocks import BlockSpan, SessionCache
from ...p2p import ErrorCode, ForwardRequest, OpenSession, ProtocolError, Step
from .compute import ComputeWorker
from .config import ServerConfig

__all__ = ["SpanBackend"]


class SpanBackend:
    def __init__(self, span: BlockSpan, model_uid: str, config: ServerConfig, compute: ComputeWorker):
        self.span, self.model_uid, self.config, self.compute = span, model_uid, config, compute
        self.dtype = getattr(torch, config.dtype)
        self.hidden_size = span.config.hidden_size


    def check_range(self, model: str, start: int, end: int) -> None:
        if model != self.model_uid:
            raise ProtocolError(f"this server serves {self.model_uid!r}, not {model!r}", ErrorCode.NOT_SERVING)
        if not self.span.start <= start < end <= self.span.end:
            raise ProtocolError(
                f"blocks {start}:{end} are not within the served {self.span.start}:{self.span.end}",
                ErrorCode.NOT_SERVING,
            )

    def open_session(self, request: OpenSession) -> SessionCache:
        self.check_range(request.model, request.start, request.end)
        if request.batch > self.config.max_batch:
            raise ProtocolError(f"batch {request.batch} exceeds this server's limit of {self.config.max_batch}",
                                ErrorCode.TOO_LARGE)
        if request.max_length > self.config.max_length:
            raise ProtocolError(f"max_length {request.max_length} exceeds this server's limit of "
                                f"{self.config.max_length}", ErrorCode.TOO_LARGE)
        return SessionCache(self.span.config, request.start, request.end, request.batch, request.max_length,
                            self.dtype, self.config.device)

    def _check_hidden(self, hidden: torch.Tensor, batch: int | None = None) -> None:
        if hidden.ndim != 3 or hidden.shape[2] != self.hidden_size or hidden.shape[1] == 0:
            raise ProtocolError(f"hidden states must be [batch, tokens >= 1, {self.hidden_size}], "
                                f"got {list(hidden.shape)}")
        if batch is not None and hidden.shape[0] != batch:
            raise ProtocolError(f"the session was opened for batch {batch}, got {hidden.shape[0]} rows")

    def _check_mask(self, mask: torch.Tensor | None, hidden: torch.Tensor) -> None:
        if mask is not None and mask.shape != hidden.shape[:2]:
            raise ProtocolError(f"padding_mask must be {list(hidden.shape[:2])}, got {list(mask.shape)}")

    async def step(self, cache: SessionCache, step: Step) -> torch.Tensor:
        self._check_hidden(step.hidden, cache.batch)
        self._check_mask(step.padding_mask, step.hidden)
        num_new = step.hidden.shape[1]
        if step.position > cache.length:
            raise ProtocolError(f"position {step.position} is past the {cache.length} cached tokens")
        if step.position + num_new > cache.max_length:
            raise ProtocolError(f"{step.position} + {num_new} tokens exceed the session's max_length "
                                f"{cache.max_length}", ErrorCode.TOO_LARGE)
        hypo_ids = step.hypo_ids
        if hypo_ids is not None and (hypo_ids.shape != (cache.batch,) or not bool(
                ((hypo_ids >= 0) & (hypo_ids < cache.batch)).all())):
            raise ProtocolError(f"hypo_ids must be [{cache.batch}] indices into the batch")
        return await self.compute.run(self._step, cache, step, rows=step.hidden.shape[0] * num_new)

    def _step(self, cache: SessionCache, step: Step) -> torch.Tensor:
        with torch.inference_mode():
            if step.hypo_ids is not None:
                cache.reorder(step.hypo_ids)
            hidden = step.hidden.to(self.config.device, self.dtype)
            padding_mask = cache.begin_step(step.position, step.padding_mask, hidden.shape[1])
            output = self.span(hidden, padding_mask, cache, cache.start, cache.end)
            return output.to("cpu", step.hidden.dtype)

    async def forward(self, request: ForwardRequest) -> torch.Tensor:
        self.check_range(request.model, request.start, request.end)
        self._check_hidden(request.hidden)
        self._check_mask(request.padding_mask, request.hidden)
        if request.hidden.shape[0] > self.config.max_batch:
            raise ProtocolError(f"batch {request.hidden.shape[0]} exceeds the limit of {self.config.max_batch}",
                                ErrorCode.TOO_LARGE)
        return await self.compute.run(self._forward, request, rows=request.hidden.shape[:2].numel())

    def _forward(self, request: ForwardRequest) -> torch.Tensor:
        with torch.inference_mode():
            hidden = request.hidden.to(self.config.device, self.dtype)
            mask = None if request.padding_mask is None else request.padding_mask.to(self.config.device)
            output = self.span(hidden, mask, None, request.start, request.end)
            return output.to("cpu", request.hidden.dtype)
