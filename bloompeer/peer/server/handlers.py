"""Stream handlers: the server side of bloompeer's RPCs, one loop per stream.

A known error becomes an error frame with its code; anything unexpected is logged with its
traceback and answered as `internal`; the stream (and every other stream) keeps going.
Only a frame whose body could not be read (too large) ends the stream, as the framing is
then lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from ...p2p import (
    CloseSession, ErrorCode, ErrorFrame, ForwardRequest, Message, OpenSession, ProtocolError, ServerInfo,
    SessionReady, Step, StepOutput, decode_message, read_frame, write_frame,
)
from .backend import SpanBackend
from .sessions import Session

__all__ = ["handle_inference_stream", "handle_forward_stream", "handle_info_stream"]

logger = logging.getLogger(__name__)

FrameHandler = Callable[[dict[str, Any]], Awaitable[Message | None]]


async def _serve_frames(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handle: FrameHandler, max_frame_bytes: int, peer: str
) -> None:
    """Answer frames until end of stream or until `handle` returns None (the client closed)."""
    while True:
        try:
            frame = await read_frame(reader, max_frame_bytes)
        except asyncio.IncompleteReadError:
            return
        except ProtocolError as exc:
            await write_frame(writer, ErrorFrame(exc.code, str(exc)).to_wire())
            if exc.code is ErrorCode.TOO_LARGE:
                return  # the unread body is still in the stream
            continue
        try:
            reply = await handle(frame)
        except ProtocolError as exc:
            logger.debug("Refused a request from %s: %s", peer, exc)
            reply = ErrorFrame(exc.code, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("Request from %s failed", peer)
            reply = ErrorFrame(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        if reply is None:
            return
        await write_frame(writer, reply.to_wire())


async def _run_stream(name: str, context: StreamInfo, writer: asyncio.StreamWriter, loop: Awaitable[None]) -> None:
    peer = context.peer_id.to_base58()
    try:
        await loop
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        logger.debug("%s stream from %s lost: %s", name, peer, exc)
    finally:
        writer.close()


class _InferenceStream:
    """One client's inference session on this server: at most one open session per stream."""

    def __init__(self, backend: SpanBackend, peer_id_str: str, writer: asyncio.StreamWriter):
        self.backend, self.peer_id_str, self.writer = backend, peer_id_str, writer
        self.session: Session | None = None

    async def handle(self, frame: dict[str, Any]) -> Message | None:
        message = decode_message(frame, OpenSession, Step, CloseSession)
        if isinstance(message, OpenSession):
            if self.session is not None:
                raise ProtocolError("a session is already open on this stream")
            self.session = await self.backend.open_session(self.peer_id_str, message, self.writer.close)
            return SessionReady()
        if isinstance(message, Step):
            if self.session is None:
                raise ProtocolError("step before open")
            return StepOutput(await self.backend.step(self.session, message))
        return None  # CloseSession: end the stream, which frees the cache

    async def close(self) -> None:
        if self.session is not None:
            await self.backend.registry.close(self.session)


async def handle_inference_stream(backend: SpanBackend, context: StreamInfo, reader, writer) -> None:
    peer_id_str = context.peer_id.to_base58()
    stream = _InferenceStream(backend, peer_id_str, writer)
    try:
        loop = _serve_frames(reader, writer, stream.handle, backend.config.max_frame_bytes, peer_id_str)
        await _run_stream("inference", context, writer, loop)
    finally:
        await stream.close()


async def handle_forward_stream(backend: SpanBackend, context: StreamInfo, reader, writer) -> None:
    async def handle(frame: dict[str, Any]) -> Message:
        request = decode_message(frame, ForwardRequest)
        return StepOutput(await backend.forward(request))

    loop = _serve_frames(reader, writer, handle, backend.config.max_frame_bytes, context.peer_id.to_base58())
    await _run_stream("forward", context, writer, loop)


async def handle_info_stream(info: Callable[[], ServerInfo], context: StreamInfo, reader, writer) -> None:
    async def send_info() -> None:
        await write_frame(writer, info().to_wire())

    await _run_stream("info", context, writer, send_info())
