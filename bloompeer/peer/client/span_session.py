"""What a client asks of one server: an inference session over one span, or a forward or backward.

The streams themselves (timeouts, lost streams, error frames) are `p2p.streams`; here are the
messages of each request and the checks on what comes back: an answer of the wrong shape or
dtype is the server misbehaving (PeerMisbehavedError), as a lie would be.
"""

from __future__ import annotations

import torch

from ...p2p import (
    BACKWARD_PROTOCOL, FORWARD_PROTOCOL, INFERENCE_PROTOCOL, P2P, BackwardRequest, CloseSession, ErrorCode,
    ForwardRequest, Gradients, OpenSession, PeerMisbehavedError, PeerStream, SessionReady, Step, StepOutput,
    request_once, second_chance,
)
from .routing import SpanRoute

__all__ = ["SpanInferenceSession", "remote_backward", "remote_forward"]


def _about(route: SpanRoute) -> str:
    return f"blocks {route.start}:{route.end}"


class SpanInferenceSession:
    """A server-side KV cache for one span, and the stream that feeds it.

    Steps may be sent and answered apart (with push, the answer comes from upstream's push), so
    sending and receiving are separate; an answer to an earlier, abandoned step is skipped.
    """

    def __init__(self, route: SpanRoute, stream: PeerStream, session_id: str):
        self.route, self.stream, self.session_id = route, stream, session_id

    @classmethod
    async def open(cls, p2p: P2P, route: SpanRoute, model_uid: str, batch: int, max_length: int,
                   timeout_s: float, alloc_timeout_s: float) -> SpanInferenceSession:
        """Open the stream and reserve the cache; the server may wait up to `alloc_timeout_s` for room."""
        await second_chance(p2p, route.peer_id_str)  # a relayed connection made before we could be punched
        stream = await PeerStream.open(p2p, route.peer_id_str, INFERENCE_PROTOCOL, timeout_s, _about(route))
        try:
            request = OpenSession(model_uid, route.start, route.end, batch, max_length, alloc_timeout_s)
            ready = await stream.request(request, SessionReady, extra_wait_s=alloc_timeout_s)
        except BaseException:
            await stream.close()
            raise
        return cls(route, stream, ready.session_id)

    async def step(self, step: Step) -> torch.Tensor:
        """Send one step and wait for its output ([batch, new, hidden], like the step's hidden)."""
        await self.send(step)
        return await self.receive(step.step_id, step.hidden)

    async def send(self, step: Step) -> None:
        await self.stream.send(step)

    async def receive(self, step_id: int, like: torch.Tensor) -> torch.Tensor:
        """The output of step `step_id` (answers to earlier, abandoned steps are skipped)."""
        while True:
            reply = await self.stream.receive(StepOutput)
            if reply.step_id == step_id:
                return _checked_output(reply.hidden, like, self.route)

    async def close(self) -> None:
        await self.stream.close(CloseSession())


async def remote_forward(p2p: P2P, route: SpanRoute, model_uid: str, hidden: torch.Tensor,
                         padding_mask: torch.Tensor | None, timeout_s: float, prompts: torch.Tensor | None = None,
                         codec: str = "raw") -> torch.Tensor:
    """One full forward of `hidden` through the route's span, on a stream of its own; tensors both
    ways packed with `codec`."""
    request = ForwardRequest(model_uid, route.start, route.end, hidden, padding_mask, prompts, codec, codec)
    reply = await request_once(p2p, route.peer_id_str, FORWARD_PROTOCOL, request, StepOutput, timeout_s,
                               _about(route))
    return _checked_output(reply.hidden, hidden, route)


async def remote_backward(p2p: P2P, route: SpanRoute, model_uid: str, hidden: torch.Tensor,
                          grad_output: torch.Tensor, padding_mask: torch.Tensor | None, timeout_s: float,
                          prompts: torch.Tensor | None = None,
                          codec: str = "raw") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the span's input (and deep prompts) for `grad_output`, from the route's server."""
    request = BackwardRequest(model_uid, route.start, route.end, hidden, grad_output, padding_mask, prompts, codec,
                              codec)
    reply = await request_once(p2p, route.peer_id_str, BACKWARD_PROTOCOL, request, Gradients, timeout_s,
                               _about(route))
    grad_prompts = reply.grad_prompts
    if (prompts is None) != (grad_prompts is None) or (prompts is not None and grad_prompts.shape != prompts.shape):
        raise _misbehaved(route, "returned gradients that do not match the prompts sent")
    return _checked_output(reply.grad_hidden, hidden, route), grad_prompts


def _misbehaved(route: SpanRoute, message: str) -> PeerMisbehavedError:
    return PeerMisbehavedError(ErrorCode.BAD_REQUEST, f"{_about(route)}: {message}", route.peer_id_str)


def _checked_output(output: torch.Tensor, sent: torch.Tensor, route: SpanRoute) -> torch.Tensor:
    if output.shape != sent.shape or output.dtype != sent.dtype:
        raise _misbehaved(route, f"returned {output.dtype} {list(output.shape)} for {sent.dtype} {list(sent.shape)}")
    return output
