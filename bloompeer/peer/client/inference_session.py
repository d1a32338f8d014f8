"""An inference session across the whole chain, surviving servers that fail mid-generation.

The client sends each step's hidden states along the route; the servers keep the attention
caches. Without push, the client sends a step span by span; with push, the step
goes to the first server only, each server sends its output straight on to the next one, and
every server also sends its output back to the client (which: ClientConfig.push, by default
chosen with the route). For every span the client keeps what the span
received. When a server fails (lost stream, error frame, no answer in time), it is banned for a
while, its blocks are routed again, and the kept inputs are replayed, step by step as first
sent, to the new servers to rebuild their caches; then the step goes on, span by span. The
output is the same as without the fault.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from dataclasses import dataclass, field

import torch

from ...p2p import P2P, PushTarget, RemoteError, RequestError, Step
from .config import ClientConfig
from .errors import SessionClosedError
from .retry import Refusals, on_a_route
from .routing import RequestSize, RoutePlan, SpanRoute
from .span_session import SpanInferenceSession
from .swarm import SwarmView
from .verification import OutputVerifier

__all__ = ["InferenceSession"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _SpanInput:
    """What one span received in one step (hidden entering its first block): kept so that a
    replacement server can be given the same steps again, and trimmed by a rewind."""

    position: int
    hidden: torch.Tensor  # [batch, new, hidden_size]
    padding_mask: torch.Tensor | None
    hypo_ids: torch.Tensor | None
    prompts: torch.Tensor | None = None  # [all blocks, batch, k, hidden_size]: each span gets its blocks' part

    def message(self, step_id: int, route: SpanRoute, push: tuple[PushTarget, ...] = ()) -> Step:
        return Step(self.position, self.hidden, self.padding_mask, self.hypo_ids, step_id, push,
                    route.blocks_of(self.prompts))

    def with_hidden(self, hidden: torch.Tensor) -> _SpanInput:
        """The same step as the next span receives it."""
        return dataclasses.replace(self, hidden=hidden)

    def truncated(self, position: int) -> _SpanInput | None:
        """This step without its tokens at `position` and after (None if nothing is left)."""
        keep = position - self.position
        if keep <= 0:
            return None
        if keep >= self.hidden.shape[1]:
            return self
        mask = None if self.padding_mask is None else self.padding_mask[:, :keep]
        prompts = None if self.prompts is None else self.prompts[:, :, :keep]
        return _SpanInput(self.position, self.hidden[:, :keep], mask, self.hypo_ids, prompts)


@dataclass
class _Span:
    """One piece of the chain: its server's session, and every step it has received so far."""

    route: SpanRoute
    session: SpanInferenceSession
    inputs: list[_SpanInput] = field(default_factory=list)


class InferenceSession:
    """One sequence (or batch of them) being decoded through the whole chain of servers.

    It is the only object that knows the chain of one generation: which server holds which blocks'
    cache, and what each was sent, because that is what it takes to survive a server's failure
    without a visible trace (the replacement is given the same steps, and the output does not
    change). Its methods are coroutines on the client's loop; a model calls them through its
    client's runtime. A server's failure is handled by the client's one retry loop (retry.py)
    from the error's class: refused, banned for a while, or banned for lying or breaking the
    protocol; a request no server can take (RequestError) reaches the caller at once.
    """

    def __init__(self, p2p: P2P, swarm: SwarmView, config: ClientConfig, max_length: int,
                 verifier: OutputVerifier | None = None):
        self.p2p, self.swarm, self.config, self.max_length = p2p, swarm, config, max_length
        self.verifier = verifier
        self.position = 0
        self.batch: int | None = None
        self._spans: list[_Span] = []
        self._step_ids = itertools.count(1)
        self._closed = False
        self._largest_step = 1  # tokens in the largest step so far: what a new server must take at once
        self._refusals: Refusals = {}  # servers whose limits this session is over: not used again for it
        self.push: bool | None = config.push  # decided with the first route, if the config leaves it open

    @property
    def route(self) -> list[SpanRoute]:
        return [span.route for span in self._spans]

    async def step(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None,
                   hypo_ids: torch.Tensor | None = None, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [batch, new, hidden_size] after the embeddings -> the last block's output.

        padding_mask: [batch, new] bool, False at padding. hypo_ids: [batch] beam reordering of
        the rows cached so far. prompts: [all blocks, batch, k <= new, hidden_size] deep prompts
        for the first k new tokens (sent span by span, never pushed).
        """
        self._check_open("it takes no more steps")
        num_new = hidden.shape[1]
        if self.position + num_new > self.max_length:
            raise RequestError(f"the session was opened for max_length={self.max_length}; "
                               f"{self.position} + {num_new} tokens do not fit (open it longer)")
        self._largest_step = max(self._largest_step, num_new)
        if self.batch is None:
            await self.open(hidden.shape[0])
        elif hidden.shape[0] != self.batch:
            raise RequestError(f"the session was opened for batch {self.batch}, got {hidden.shape[0]} rows")
        given = _SpanInput(self.position, hidden, padding_mask, hypo_ids, prompts)  # to the next span
        push = self.push and len(self._spans) > 1 and prompts is None
        pushed = await self._push_along(given) if push else []
        index = 0
        while index < len(self._spans):
            span = self._spans[index]
            try:
                if index < len(pushed):  # answered (or failed) during the push
                    output = pushed[index]
                    if isinstance(output, BaseException):
                        raise output
                else:
                    output = await span.session.step(given.message(next(self._step_ids), span.route))
            except RemoteError as exc:
                self._check_open("its step failed as it closed (no new servers are opened to go on)", exc)
                await span.session.close()
                self._spans[index:index + 1], pushed = await self._build(
                    span.route.start, span.route.end, span.inputs, self.config.recovery_timeout_s, exc), []
                continue  # the same step, on the new spans, one by one
            if self.verifier is not None and self.verifier.sampled() and await self._found_lying(span, given, output):
                self._spans[index:index + 1], pushed = await self._build_after_lie(span), []
                continue  # downstream answers came from the lie: redo them too
            span.inputs.append(given)
            given = given.with_hidden(output)
            index += 1
        self.position += num_new
        return given.hidden

    async def open(self, batch: int) -> None:
        """Choose the route and reserve the servers' caches now (the first step does it otherwise)."""
        self._check_open("it cannot be opened again")
        if self.batch is not None:
            raise RuntimeError("this inference session is already open")
        self.batch = batch
        self._spans = await self._build(0, self.swarm.num_model_blocks, [], self.config.missing_blocks_timeout_s)

    async def _push_along(self, step: _SpanInput) -> list:
        """Send the step to the first span, to be pushed through the rest: every span's answer (an
        output or a RemoteError), in chain order."""
        step_id = next(self._step_ids)
        hops = tuple(PushTarget(span.route.peer_id_str, span.session.session_id) for span in self._spans[1:])
        try:
            await self._spans[0].session.send(step.message(step_id, self._spans[0].route, hops))
        except RemoteError as exc:
            return [exc]
        answers = await asyncio.gather(*(span.session.receive(step_id, step.hidden) for span in self._spans),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, RemoteError):
                raise answer
        return answers

    async def _found_lying(self, span: _Span, step: _SpanInput, output: torch.Tensor) -> bool:
        """Recompute the span's output elsewhere; True if its server turned out to be wrong."""
        history = span.inputs + [step]
        if any(item.hypo_ids is not None for item in history) or any(item.prompts is not None for item in history[1:]):
            return False  # not replayable as one forward: beam reordering; deep prompts not at the start
        inputs = torch.cat([item.hidden for item in history], dim=1)
        masks = [item.padding_mask if item.padding_mask is not None else
                 torch.ones(item.hidden.shape[:2], dtype=torch.bool) for item in history]
        mask = torch.cat(masks, dim=1) if any(item.padding_mask is not None for item in history) else None
        prompts = span.route.blocks_of(history[0].prompts)
        liars = await self.verifier.find_liars(span.route, inputs, mask, output, prompts)
        return span.route.peer_id_str in liars

    def _check_open(self, why: str, cause: BaseException | None = None) -> None:
        """Raise SessionClosedError once close() has begun: a closed session must neither step nor (in
        a step that was running when it closed) open sessions on new servers that nobody would close."""
        if self._closed:
            raise SessionClosedError(f"this inference session is closed: {why}") from cause

    async def _build_after_lie(self, liar: _Span) -> list[_Span]:
        await liar.session.close()  # the verifier has banned its server already
        self._check_open("a server was caught lying as it closed (no new servers are opened)")
        return await self._build(liar.route.start, liar.route.end, liar.inputs, self.config.recovery_timeout_s)

    async def _build(self, start: int, end: int, inputs: list[_SpanInput], wait_s: float,
                     failed: RemoteError | None = None) -> list[_Span]:
        """Sessions on a route through blocks [start, end), with `inputs` replayed to them; routed
        again (see retry.py) whenever a server fails while opening or replaying."""

        async def attempt(plan: RoutePlan) -> list[_Span]:
            spans: list[_Span] = []
            try:
                self._check_open("no new servers are opened for it")
                await self._open(plan.route, spans)
                if inputs:
                    await self._replay(spans, inputs)
                self._check_open("it closed while new servers were opened for it (now closed again)")
                self.push = plan.push
                return spans
            except BaseException:
                await asyncio.gather(*(span.session.close() for span in spans), return_exceptions=True)
                raise

        size = RequestSize(self.batch, self.max_length, self.batch * self._largest_step)
        return await on_a_route(self.swarm, start, end, attempt, size, self._refusals, wait_s=wait_s,
                                recovery_s=self.config.recovery_timeout_s, poll_period_s=self.config.poll_period_s,
                                min_cache_tokens=self.batch * self.max_length, failed=failed, push=self.push)

    async def _open(self, route: list[SpanRoute], spans: list[_Span]) -> None:
        """Open a session on every piece of the route, in parallel; `spans` gets those that opened, also
        when this is cancelled halfway (a caller that left): the caller closes them."""
        opening = [asyncio.ensure_future(SpanInferenceSession.open(
            self.p2p, piece, self.swarm.model_uid, self.batch, self.max_length, self.config.request_timeout_s,
            self.config.alloc_timeout_s)) for piece in route]
        try:
            await asyncio.gather(*opening, return_exceptions=True)
        finally:  # cancelled, gather cancels those still opening (each closes its own stream)
            spans += [_Span(piece, task.result()) for piece, task in zip(route, opening)
                      if task.done() and not task.cancelled() and task.exception() is None]
        for task in opening:
            if task.exception() is not None:
                raise task.exception()

    async def _replay(self, spans: list[_Span], inputs: list[_SpanInput]) -> None:
        logger.info("Replaying %d step(s) (%d tokens) to %s", len(inputs), self.position,
                    ", ".join(f"{s.route.peer_id_str[-8:]}[{s.route.start}:{s.route.end}]" for s in spans))
        for span in spans:
            outputs = []
            for given in inputs:
                message = given.message(next(self._step_ids), span.route)
                outputs.append(given.with_hidden(await span.session.step(message)))
            span.inputs, inputs = list(inputs), outputs

    def rewind(self, position: int) -> None:
        """Forget tokens after `position`: the next step overwrites them on every server."""
        if not 0 <= position <= self.position:
            raise RequestError(f"cannot rewind to {position}: {self.position} tokens are cached")
        self.position = position
        for span in self._spans:
            span.inputs = [kept for given in span.inputs if (kept := given.truncated(position)) is not None]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(span.session.close() for span in self._spans), return_exceptions=True)
