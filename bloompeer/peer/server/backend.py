"""The blocks a server holds, and the checked requests it runs on them for its peers.

Stream handlers decode frames; this module checks that a request fits the model, the limits
and the session (shapes, ranges, positions), then hands it to the scheduler. A request that
fails is answered with `error_frame`: its code, or `internal` for a bug.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import torch

from ...blocks import BlockSpan, SessionCache
from ...p2p import BackwardRequest, ErrorCode, ErrorFrame, ForwardRequest, Message, OpenSession, ProtocolError, Step
from .config import ServerConfig
from .metrics import ServerMetrics
from .scheduler import Scheduler
from .sessions import Session, SessionRegistry
from .step_clock import StepClock

__all__ = ["SpanBackend", "error_frame"]

logger = logging.getLogger(__name__)


class SpanBackend:
    """Checks requests for the span served and runs them. `server_config` is the server's settings
    (limits, device, dtype); `span.config` is the model's (transformers') config."""

    def __init__(self, span: BlockSpan, model_uid: str, server_config: ServerConfig, registry: SessionRegistry,
                 scheduler: Scheduler, accepting: Callable[[], bool], metrics: ServerMetrics):
        self.span, self.model_uid, self.server_config = span, model_uid, server_config
        self.registry, self.scheduler, self.accepting, self.metrics = registry, scheduler, accepting, metrics
        self.dtype = server_config.torch_dtype
        self.hidden_size = span.config.hidden_size

    def _check_serving(self, model: str, start: int, end: int) -> None:
        if not self.accepting():
            raise ProtocolError("this server is shutting down; use another", ErrorCode.NOT_SERVING)
        if model != self.model_uid:
            raise ProtocolError(f"this server serves {self.model_uid!r}, not {model!r}", ErrorCode.NOT_SERVING)
        if not self.span.start <= start < end <= self.span.end:
            raise ProtocolError(
                f"blocks {start}:{end} are not within the served {self.span.start}:{self.span.end}",
                ErrorCode.NOT_SERVING,
            )

    def _check_limit(self, what: str, value: int, limit: int, flag: str) -> None:
        """Refuse a request over one of this server's limits, naming the value, the limit and its flag."""
        if value > limit:
            raise ProtocolError(f"{what} {value} exceeds this server's limit of {limit} (bloompeer serve {flag})",
                                ErrorCode.TOO_LARGE)

    async def open_session(self, peer_id_str: str, request: OpenSession, on_expire: Callable[[], None],
                           deliver: Callable[[Message], Awaitable[None]]) -> Session:
        self._check_serving(request.model, request.start, request.end)
        self._check_limit("batch", request.batch, self.server_config.max_batch, "--max-batch")
        self._check_limit("max_length", request.max_length, self.server_config.max_length, "--max-length")
        nbytes = self.span.cache_nbytes(request.start, request.end, request.batch, request.max_length, self.dtype)

        def make_cache() -> SessionCache:
            return self.span.new_cache(request.start, request.end, request.batch, request.max_length, self.dtype,
                                       self.server_config.device)

        timeout_s = min(request.alloc_timeout_s, self.server_config.max_alloc_timeout_s)
        return await self.registry.open(peer_id_str, nbytes, timeout_s, make_cache, on_expire, deliver)

    def _check_hidden(self, hidden: torch.Tensor, mask: torch.Tensor | None, batch: int | None = None) -> None:
        if hidden.ndim != 3 or hidden.shape[2] != self.hidden_size or 0 in hidden.shape[:2]:
            raise ProtocolError(f"hidden states must be [batch >= 1, tokens >= 1, {self.hidden_size}], "
                                f"got {list(hidden.shape)}")
        if batch is not None and hidden.shape[0] != batch:
            raise ProtocolError(f"the session was opened for batch {batch}, got {hidden.shape[0]} rows")
        if mask is not None and mask.shape != hidden.shape[:2]:
            raise ProtocolError(f"padding_mask must be {list(hidden.shape[:2])}, got {list(mask.shape)}")
        self._check_limit("rows (batch x tokens) per request", hidden.shape[:2].numel(),
                          self.server_config.max_step_tokens, "--max-step-tokens")

    async def step(self, session: Session, step: Step, clock: StepClock | None = None) -> torch.Tensor:
        """The step's output; its passes are timed on `clock`."""
        async with session.stepping:
            return await self._step(session, step, clock)

    async def _step(self, session: Session, step: Step, clock: StepClock | None) -> torch.Tensor:
        if not self.accepting():
            raise ProtocolError("this server is shutting down; move the session elsewhere", ErrorCode.NOT_SERVING)
        cache = session.cache
        if cache is None:
            raise ProtocolError(f"the session was closed after {self.server_config.session_timeout_s:.0f} s idle",
                                ErrorCode.TIMEOUT)
        self._check_hidden(step.hidden, step.padding_mask, cache.batch)
        num_new = step.hidden.shape[1]
        if step.position > cache.length:
            raise ProtocolError(f"position {step.position} is past the {cache.length} cached tokens")
        if step.position + num_new > cache.max_length:
            raise ProtocolError(f"{step.position} + {num_new} tokens exceed the session's max_length "
                                f"{cache.max_length}", ErrorCode.TOO_LARGE)
        self._check_prompts(step.prompts, cache.end - cache.start, step.hidden)
        _check_push(session, step)
        hypo_ids = step.hypo_ids
        if hypo_ids is not None and (hypo_ids.shape != (cache.batch,) or not bool(
                ((hypo_ids >= 0) & (hypo_ids < cache.batch)).all())):
            raise ProtocolError(f"hypo_ids must be [{cache.batch}] indices into the batch")
        try:
            return await self.scheduler.step(session.id, cache, step, clock)
        finally:
            session.touch()

    def _check_whole_sequences(self, request: ForwardRequest | BackwardRequest) -> None:
        self._check_serving(request.model, request.start, request.end)
        self._check_hidden(request.hidden, request.padding_mask)
        self._check_limit("batch", request.hidden.shape[0], self.server_config.max_batch, "--max-batch")
        self._check_limit("length", request.hidden.shape[1], self.server_config.max_length, "--max-length")
        self._check_prompts(request.prompts, request.end - request.start, request.hidden)

    def _check_prompts(self, prompts: torch.Tensor | None, num_blocks: int, hidden: torch.Tensor) -> None:
        """Deep prompts: [num_blocks, batch, 1 <= k <= the request's tokens, hidden_size]."""
        batch, length = hidden.shape[:2]
        if prompts is not None and (prompts.ndim != 4 or prompts.shape[:2] != (num_blocks, batch)
                                    or not 1 <= prompts.shape[2] <= length or prompts.shape[3] != self.hidden_size):
            raise ProtocolError(f"prompts must be [{num_blocks} blocks, {batch}, 1..{length} tokens, "
                                f"{self.hidden_size}], got {list(prompts.shape)}")

    async def forward(self, request: ForwardRequest) -> torch.Tensor:
        self._check_whole_sequences(request)
        return await self.scheduler.forward(request.hidden, request.padding_mask, request.start, request.end,
                                            request.prompts)

    async def backward(self, request: BackwardRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of the span's input (and deep prompts) for the given output gradient."""
        self._check_whole_sequences(request)
        if request.grad_output.shape != request.hidden.shape:
            raise ProtocolError(f"grad_output must be shaped like hidden {list(request.hidden.shape)}, "
                                f"got {list(request.grad_output.shape)}")
        return await self.scheduler.backward(request)


def _check_push(session: Session, step: Step) -> None:
    """The hops a step is pushed on to must be distinct sessions, none of them this one: a chain that
    names a session twice would make one frame cost a pass per naming (a loop through this server, or
    between two), where a real chain costs one pass per session its client opened."""
    sessions = {session.id, *(hop.session_id for hop in step.push)}
    if len(sessions) != len(step.push) + 1:
        raise ProtocolError("push: every hop must be another session, named once")


def error_frame(exc: Exception, peer: str) -> ErrorFrame:
    """What a failed request is answered with: its code, or `internal` (logged) for a bug."""
    if isinstance(exc, ProtocolError):
        logger.debug("Refused a request from %s: %s", peer, exc)
        return ErrorFrame(exc.code, str(exc))
    logger.error("Request from %s failed", peer, exc_info=exc)
    return ErrorFrame(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
