"""The client end of one server's stream: an inference session, or a forward, over one span.

Each call sends a frame and waits, with a timeout, for the answer; an error frame becomes the
matching RemoteError, a lost stream or a timeout a PeerUnavailableError.
"""

from __future__ import annotations

import asyncio

import torch
from hivemind.p2p import P2P, P2PDaemonError, PeerID

from ...p2p import (
    BACKWARD_PROTOCOL, FORWARD_PROTOCOL, INFERENCE_PROTOCOL, BackwardRequest, CloseSession, ErrorCode, ErrorFrame,
    ForwardRequest, Gradients, Message, OpenSession, PeerUnavailableError, ProtocolError, RemoteError, SessionReady,
    Step, StepOutput, decode_message, read_frame, remote_error, write_frame,
)
from .routing import SpanRoute

__all__ = ["SpanStream", "SpanInferenceSession", "remote_backward", "remote_forward"]


class SpanStream:
    """One open stream to one server, used for requests and answers in turn."""

    def __init__(self, route: SpanRoute, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout_s: float):
        self.route, self.reader, self.writer, self.timeout_s = route, reader, writer, timeout_s

    @classmethod
    async def connect(cls, p2p: P2P, route: SpanRoute, protocol: str, timeout_s: float) -> SpanStream:
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(route.peer_id_str), protocol), timeout_s)
        except (P2PDaemonError, ConnectionError, asyncio.TimeoutError) as exc:
            raise _unavailable(route, f"could not open a stream: {exc!r}") from exc
        return cls(route, reader, writer, timeout_s)

    async def request(self, message: Message, *expected: type[Message], extra_wait_s: float = 0.0) -> Message:
        await self.send(message)
        return await self.receive(*expected, extra_wait_s=extra_wait_s)

    async def send(self, message: Message) -> None:
        try:
            await write_frame(self.writer, message.to_wire())
        except (ConnectionError, RuntimeError) as exc:
            raise _unavailable(self.route, f"stream lost: {exc!r}") from exc

    async def receive(self, *expected: type[Message], extra_wait_s: float = 0.0) -> Message:
        timeout_s = self.timeout_s + extra_wait_s
        try:
            frame = await asyncio.wait_for(read_frame(self.reader), timeout_s)
        except asyncio.TimeoutError as exc:
            raise _unavailable(self.route, f"no answer within {timeout_s:.0f} s", ErrorCode.TIMEOUT) from exc
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise _unavailable(self.route, f"stream lost: {exc!r}") from exc
        try:
            reply = decode_message(frame, ErrorFrame, *expected)
        except ProtocolError as exc:
            raise _misbehaved(self.route, f"sent an invalid reply: {exc}") from exc
        if isinstance(reply, ErrorFrame):
            raise remote_error(reply.code, reply.message, self.route.peer_id_str)
        return reply

    async def close(self, goodbye: Message | None = None) -> None:
        try:
            if goodbye is not None:
                await write_frame(self.writer, goodbye.to_wire())
        except (ConnectionError, RuntimeError):
            pass
        finally:
            self.writer.close()


def _unavailable(route: SpanRoute, message: str, code: ErrorCode = ErrorCode.NOT_SERVING) -> PeerUnavailableError:
    return PeerUnavailableError(code, f"blocks {route.start}:{route.end}: {message}", route.peer_id_str)


def _misbehaved(route: SpanRoute, message: str) -> RemoteError:
    """A server broke the protocol: treated like a failure of that server."""
    return RemoteError(ErrorCode.BAD_REQUEST, f"blocks {route.start}:{route.end}: {message}", route.peer_id_str)


class SpanInferenceSession:
    """A server-side KV cache for one span, and the stream that feeds it."""

    def __init__(self, stream: SpanStream, session_id: str):
        self.stream, self.session_id = stream, session_id

    @classmethod
    async def open(cls, p2p: P2P, route: SpanRoute, model_uid: str, batch: int, max_length: int,
                   timeout_s: float, alloc_timeout_s: float) -> SpanInferenceSession:
        stream = await SpanStream.connect(p2p, route, INFERENCE_PROTOCOL, timeout_s)
        try:
            request = OpenSession(model_uid, route.start, route.end, batch, max_length, alloc_timeout_s)
            ready = await stream.request(request, SessionReady, extra_wait_s=alloc_timeout_s)
        except BaseException:
            await stream.close()
            raise
        return cls(stream, ready.session_id)

    async def step(self, step: Step) -> torch.Tensor:
        await self.send(step)
        return await self.receive(step.step_id, step.hidden)

    async def send(self, step: Step) -> None:
        await self.stream.send(step)

    async def receive(self, step_id: int, like: torch.Tensor) -> torch.Tensor:
        """The output of step `step_id` (answers to earlier, abandoned steps are skipped)."""
        while True:
            reply = await self.stream.receive(StepOutput)
            if reply.step_id == step_id:
                return _checked_output(reply.hidden, like, self.stream.route)

    async def close(self) -> None:
        await self.stream.close(CloseSession())


async def remote_forward(p2p: P2P, route: SpanRoute, model_uid: str, hidden: torch.Tensor,
                         padding_mask: torch.Tensor | None, timeout_s: float, prompts: torch.Tensor | None = None,
                         codec: str = "raw") -> torch.Tensor:
    """One full forward of `hidden` through the route's span, on a stream of its own; tensors both
    ways packed with `codec`."""
    request = ForwardRequest(model_uid, route.start, route.end, hidden, padding_mask, prompts, codec, codec)
    reply = await _request_once(p2p, route, FORWARD_PROTOCOL, request, StepOutput, timeout_s)
    return _checked_output(reply.hidden, hidden, route)


async def remote_backward(p2p: P2P, route: SpanRoute, model_uid: str, hidden: torch.Tensor,
                          grad_output: torch.Tensor, padding_mask: torch.Tensor | None, timeout_s: float,
                          prompts: torch.Tensor | None = None,
                          codec: str = "raw") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the span's input (and deep prompts) for `grad_output`, from the route's server."""
    request = BackwardRequest(model_uid, route.start, route.end, hidden, grad_output, padding_mask, prompts, codec,
                              codec)
    reply = await _request_once(p2p, route, BACKWARD_PROTOCOL, request, Gradients, timeout_s)
    grad_prompts = reply.grad_prompts
    if (prompts is None) != (grad_prompts is None) or (prompts is not None and grad_prompts.shape != prompts.shape):
        raise _misbehaved(route, "returned gradients that do not match the prompts sent")
    return _checked_output(reply.grad_hidden, hidden, route), grad_prompts


async def _request_once(p2p: P2P, route: SpanRoute, protocol: str, request: Message, expected: type[Message],
                        timeout_s: float) -> Message:
    stream = await SpanStream.connect(p2p, route, protocol, timeout_s)
    try:
        return await stream.request(request, expected)
    finally:
        await stream.close()


def _checked_output(output: torch.Tensor, sent: torch.Tensor, route: SpanRoute) -> torch.Tensor:
    if output.shape != sent.shape or output.dtype != sent.dtype:
        raise _misbehaved(route, f"returned {output.dtype} {list(output.shape)} for {sent.dtype} {list(sent.shape)}")
    return output
