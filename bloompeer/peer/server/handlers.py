"""Stream handlers: the server side of bloompeer's RPCs, one loop per stream. What becomes of a
step's output (pushed on, answered) is push.py's.

A known error becomes an error frame with its code; anything unexpected is logged with its
traceback and answered as `internal`; the stream (and every other stream) keeps going. Only a
frame whose body could not be read (too large) ends the stream, as the framing is then lost.
The streams are p2p's `IncomingStream`s: their end and their loss arrive as bloompeer's (None,
PeerUnavailableError), never as asyncio's or the daemon's errors.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ...p2p import (
    BACKWARD_PROTOCOL, FORWARD_PROTOCOL, INFERENCE_PROTOCOL, PUSH_PROTOCOL, BackwardRequest, CloseSession, ErrorCode,
    ErrorFrame, ForwardRequest, Gradients, IncomingStream, Message, OpenSession, PeerUnavailableError, ProtocolError,
    PushStep, ServerInfo, SessionReady, Step, StepOutput, decode_message,
)
from .backend import SpanBackend, error_frame
from .current_node import CurrentNode
from .metrics import OK, ServerMetrics
from .push import PushSender, pushed_session, run_step
from .sessions import Session

__all__ = [
    "handle_inference_stream", "handle_forward_stream", "handle_info_stream", "handle_push_stream", "serve_requests",
]

logger = logging.getLogger(__name__)

CLOSE = object()  # a frame handler's answer meaning "the client is done: end the stream"
# Steps of one push stream being computed or answered at once; the stream is read on as they finish.
# The previous server pushes every session it shares with us on one stream, and a pass batches at
# most a few dozen of them: more in flight would only queue, each holding its frame.
MAX_PUSHED_IN_FLIGHT = 64
# An answer the session's client has not taken in this long ends the session: its client stopped
# reading, and the step (with its output) would otherwise wait for it forever. Twice a client's
# default request timeout (ClientConfig.request_timeout_s), which includes the answer's transfer.
DELIVER_TIMEOUT_S = 60.0
FrameHandler = Callable[[dict[str, Any]], Awaitable[Message | None | object]]


def _frame_kind(frame: dict[str, Any]) -> str:
    """The kind of request a frame is, for the metrics (its type; unknown types become "invalid")."""
    kind = frame.get("type")
    return kind if isinstance(kind, str) else "invalid"


async def _serve_frames(stream: IncomingStream, send: Callable[[Message], Awaitable[None]],
                        handle: FrameHandler, max_frame_bytes: int, metrics: ServerMetrics) -> None:
    """Answer frames until end of stream or until `handle` returns CLOSE (None: answered, and
    counted, already)."""
    while True:
        try:
            frame = await stream.receive_frame(max_frame_bytes)
        except ProtocolError as exc:
            metrics.count_request("invalid", exc.code)
            await send(ErrorFrame(exc.code, str(exc)))
            if exc.code is ErrorCode.TOO_LARGE:
                return  # the unread body is still in the stream
            continue
        if frame is None:
            return
        try:
            reply = await handle(frame)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reply = error_frame(exc, stream.peer)
        if reply is not None:
            metrics.count_request(_frame_kind(frame), reply.code if isinstance(reply, ErrorFrame) else OK)
        if reply is CLOSE:
            return
        if reply is not None:
            await send(reply)


async def _run_stream(name: str, stream: IncomingStream, loop: Awaitable[None]) -> None:
    try:
        await loop
    except PeerUnavailableError as exc:
        logger.debug("%s stream from %s lost: %s", name, stream.peer, exc)
    finally:
        stream.close()


class _InferenceStream:
    """One client's inference stream: at most one session, whose answers (to its own steps and to
    steps pushed to it) are written on this stream."""

    def __init__(self, backend: SpanBackend, pusher: PushSender, stream: IncomingStream):
        self.backend, self.pusher, self.stream = backend, pusher, stream
        self.session: Session | None = None

    async def send(self, message: Message) -> None:
        try:
            await self.stream.send(message, DELIVER_TIMEOUT_S)
        except PeerUnavailableError as exc:  # the stream loop ends too: its reads end as the stream does
            if exc.code is ErrorCode.TIMEOUT:  # IncomingStream.send closed it
                logger.info("Ending a session of %s: it took no answer for %.0f s", self.stream.peer,
                            DELIVER_TIMEOUT_S)
            else:  # the client went away
                logger.debug("Could not answer %s: %s", self.stream.peer, exc)

    async def handle(self, frame: dict[str, Any]) -> Message | None | object:
        message = decode_message(frame, OpenSession, Step, CloseSession)
        if isinstance(message, OpenSession):
            if self.session is not None:
                raise ProtocolError("a session is already open on this stream")
            self.session = await self.backend.open_session(self.stream.peer, message, self.stream.close, self.send)
            return SessionReady(self.session.id)
        if isinstance(message, Step):
            if self.session is None:
                raise ProtocolError("step before open")
            await run_step(self.backend, self.pusher, self.session, message, self.stream.frame_received_at)
            return None
        return CLOSE  # CloseSession: end the stream, which frees the cache

    async def close(self) -> None:
        if self.session is not None:
            await self.backend.registry.close(self.session)


async def handle_inference_stream(backend: SpanBackend, pusher: PushSender, stream: IncomingStream) -> None:
    inference = _InferenceStream(backend, pusher, stream)
    try:
        loop = _serve_frames(stream, inference.send, inference.handle, backend.server_config.max_frame_bytes,
                             backend.metrics)
        await _run_stream("inference", stream, loop)
    finally:
        await inference.close()


async def handle_push_stream(serving: Callable[[], SpanBackend], pusher: PushSender, stream: IncomingStream) -> None:
    """Steps pushed by another server. Each runs as its own task, so steps of different sessions
    arriving on one stream are batched together rather than run one after another. The previous
    server keeps its stream to us open for all the sessions it pushes to us, also across a move
    of ours to other blocks: each step goes to the backend `serving()` now."""
    running: set[asyncio.Task] = set()
    in_flight = asyncio.Semaphore(MAX_PUSHED_IN_FLIGHT)

    async def handle(frame: dict[str, Any]) -> None:
        received, backend = stream.frame_received_at, serving()
        pushed = decode_message(frame, PushStep)
        session = pushed_session(backend, pushed, stream.peer)
        if session is None:
            return None
        await in_flight.acquire()  # the next frame is read once a step here is done
        task = asyncio.create_task(run_step(backend, pusher, session, pushed.step, received, pushed=True))
        running.add(task)
        task.add_done_callback(lambda done: (running.discard(done), in_flight.release()))
        return None

    async def send_nothing(message: Message) -> None:  # errors in pushed frames go to the log only
        logger.debug("Bad push from %s: %s", stream.peer, getattr(message, "message", message))

    try:
        loop = _serve_frames(stream, send_nothing, handle, serving().server_config.max_frame_bytes, serving().metrics)
        await _run_stream("push", stream, loop)
    finally:
        await asyncio.gather(*running, return_exceptions=True)


async def handle_forward_stream(backend: SpanBackend, stream: IncomingStream) -> None:
    """Full forwards and backwards of whole sequences (one protocol name each, one handler)."""

    async def handle(frame: dict[str, Any]) -> Message:
        request = decode_message(frame, ForwardRequest, BackwardRequest)
        if isinstance(request, ForwardRequest):
            return StepOutput(await backend.forward(request), codec=request.output_codec)
        grad_hidden, grad_prompts = await backend.backward(request)
        return Gradients(grad_hidden, grad_prompts, codec=request.output_codec)

    loop = _serve_frames(stream, stream.send, handle, backend.server_config.max_frame_bytes, backend.metrics)
    await _run_stream("forward", stream, loop)


async def handle_info_stream(info: Callable[[], ServerInfo], metrics: ServerMetrics, stream: IncomingStream) -> None:
    metrics.count_request("info")
    await _run_stream("info", stream, stream.send(info()))


async def serve_requests(node: CurrentNode, serving: Callable[[], SpanBackend], pusher: PushSender) -> None:
    """Answer inference, push, forward and backward streams on `node` (and on its later daemons). A
    stream is served by the backend `serving()` gives when it opens, a pushed step by the one it
    gives when the step comes: after a move of ours, streams opened before it are refused (their
    clients replay elsewhere), while the servers pushing to us keep their streams."""

    async def inference(stream: IncomingStream) -> None:
        await handle_inference_stream(serving(), pusher, stream)

    async def forward(stream: IncomingStream) -> None:
        await handle_forward_stream(serving(), stream)

    await node.serve(INFERENCE_PROTOCOL, inference)
    await node.serve(PUSH_PROTOCOL, functools.partial(handle_push_stream, serving, pusher))
    await node.serve(FORWARD_PROTOCOL, forward)
    await node.serve(BACKWARD_PROTOCOL, forward)
