"""Streams between peers: the one place bloompeer opens a libp2p stream, sends and receives its
frames, bounds every wait, and turns what hivemind and p2pd raise into bloompeer's errors.

Above this module nothing sees P2PDaemonError, ConnectionError, IncompleteReadError or a
timeout, on either end of a stream:
  - a client's `PeerStream`: a stream that cannot be opened, is lost or stays silent is a
    PeerUnavailableError (route around the peer), an error frame is the class `remote_error` maps
    its code to, and a reply we cannot decode or did not expect is a PeerMisbehavedError (ban the peer);
  - a server's `IncomingStream` (what `serve` hands a handler, with the caller's peer id as a
    string): the peer ending the stream is a clean end (None), a frame we refuse is a ProtocolError
    (answered with its code), and a lost stream or an answer not taken in time is a PeerUnavailableError.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from .errors import ErrorCode, PeerMisbehavedError, PeerUnavailableError, ProtocolError, remote_error
from .framing import read_frame, read_frame_body, unpack, write_frame
from .messages import ErrorFrame, Message, decode_message

__all__ = ["P2P", "IncomingStream", "PeerStream", "StreamHandler", "request_once", "serve", "stop_serving"]

# What hivemind, p2pd and asyncio raise when a stream cannot be opened, or is gone, while we use it.
_OPEN_FAILURES = (P2PDaemonError, OSError, ValueError)  # OSError: the daemon's socket; ValueError: not a peer id
_SEND_FAILURES = (P2PDaemonError, ConnectionError, RuntimeError)  # RuntimeError: writing to a closed transport
_RECEIVE_FAILURES = (P2PDaemonError, ConnectionError, asyncio.IncompleteReadError)


class PeerStream:
    """One open stream to one peer, used for requests and answers in turn.

    `about` starts every error message (e.g. "blocks 0:4"), so the user learns what was asked of
    whom. Every receive waits at most `timeout_s` (plus what the caller knows the peer may need).
    """

    def __init__(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float,
                 about: str = ""):
        self.peer, self.reader, self.writer, self.timeout_s, self.about = peer, reader, writer, timeout_s, about

    @classmethod
    async def open(cls, p2p: P2P, peer: str, protocol: str, timeout_s: float, about: str = "") -> PeerStream:
        """A new stream to `peer` for `protocol`; PeerUnavailableError if it cannot be opened in time."""
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol), timeout_s)
        except asyncio.TimeoutError as exc:
            raise _unavailable(peer, about, f"could not open a stream within {timeout_s:.0f} s",
                               ErrorCode.TIMEOUT) from exc
        except _OPEN_FAILURES as exc:
            raise _unavailable(peer, about, f"could not open a stream: {exc!r}") from exc
        return cls(peer, reader, writer, timeout_s, about)

    async def request(self, message: Message, *expected: type[Message], extra_wait_s: float = 0.0) -> Message:
        await self.send(message)
        return await self.receive(*expected, extra_wait_s=extra_wait_s)

    async def send(self, message: Message, timeout_s: float | None = None) -> None:
        """Write one frame; with `timeout_s`, give up if the peer does not take it in time."""
        wire = message.to_wire()
        try:
            async with asyncio.timeout(timeout_s):  # in this task: wait_for would start one per frame
                await write_frame(self.writer, wire)
        except TimeoutError as exc:
            raise _unavailable(self.peer, self.about, f"did not take a frame within {timeout_s:.0f} s",
                               ErrorCode.TIMEOUT) from exc
        except _SEND_FAILURES as exc:
            raise _unavailable(self.peer, self.about, f"stream lost: {exc!r}") from exc

    async def receive(self, *expected: type[Message], extra_wait_s: float = 0.0) -> Message:
        """The next frame, as one of the `expected` messages; an error frame is raised as its class."""
        timeout_s = self.timeout_s + extra_wait_s
        try:
            async with asyncio.timeout(timeout_s):
                frame = await read_frame(self.reader)
            reply = decode_message(frame, ErrorFrame, *expected)
        except TimeoutError as exc:
            raise _unavailable(self.peer, self.about, f"no answer within {timeout_s:.0f} s",
                               ErrorCode.TIMEOUT) from exc
        except _RECEIVE_FAILURES as exc:
            raise _unavailable(self.peer, self.about, f"stream lost: {exc!r}") from exc
        except ProtocolError as exc:
            raise self.misbehaved(f"sent an invalid reply: {exc}") from exc
        if isinstance(reply, ErrorFrame):
            raise remote_error(reply.code, _prefixed(self.about, reply.message), self.peer)
        return reply

    def misbehaved(self, message: str) -> PeerMisbehavedError:
        """The error for a reply that is well formed but wrong (e.g. ill-shaped): the peer broke the protocol."""
        return PeerMisbehavedError(ErrorCode.BAD_REQUEST, _prefixed(self.about, message), self.peer)

    async def close(self, goodbye: Message | None = None) -> None:
        """Close the stream, after a last frame if given; never raises (the peer may be gone already)."""
        try:
            if goodbye is not None:
                await write_frame(self.writer, goodbye.to_wire())
        except _SEND_FAILURES:
            pass
        finally:
            self.writer.close()


async def request_once(p2p: P2P, peer: str, protocol: str, request: Message | None, expected: type[Message],
                       timeout_s: float, about: str = "") -> Message:
    """One request and its answer on a stream of their own (None: the peer speaks first).

    A stream can be reset before the peer's handler ever sees it (about 1 stream in 200 between
    loaded processes on one machine: the peer's daemon resets it and its handler never runs). Where
    the peer speaks first, asking had no effect on it, so a stream lost that way is opened once more
    before the peer counts as unavailable (a ping or a liveness check would otherwise call a live
    server dead); one that timed out is not, as a second try would only double the wait.
    """
    try:
        return await _request_on_new_stream(p2p, peer, protocol, request, expected, timeout_s, about)
    except PeerUnavailableError as exc:
        if request is not None or exc.code is ErrorCode.TIMEOUT:
            raise
    return await _request_on_new_stream(p2p, peer, protocol, request, expected, timeout_s, about)


async def _request_on_new_stream(p2p: P2P, peer: str, protocol: str, request: Message | None,
                                 expected: type[Message], timeout_s: float, about: str) -> Message:
    stream = await PeerStream.open(p2p, peer, protocol, timeout_s, about)
    try:
        if request is not None:
            await stream.send(request)
        return await stream.receive(expected)
    finally:
        await stream.close()


def _prefixed(about: str, message: str) -> str:
    return f"{about}: {message}" if about else message


def _unavailable(peer: str, about: str, message: str, code: ErrorCode = ErrorCode.NOT_SERVING) -> PeerUnavailableError:
    return PeerUnavailableError(code, _prefixed(about, message), peer)


class IncomingStream:
    """A stream a peer opened to us, as a handler sees it: frames in as the peer sent them (the
    handler decodes the messages it takes), answers out one frame at a time.

    Answers may come from several tasks at once (steps pushed to a session answer on its client's
    stream too), so frames are written one at a time, and a send's timeout covers its wait for its
    turn. A frame the peer did not take in time may be half written: the stream is then closed.
    """

    def __init__(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.peer, self.reader, self.writer = peer, reader, writer
        self._writing = asyncio.Lock()
        # time.perf_counter() when the last frame's bytes were all in: where a request's time on this
        # peer begins (its unpacking included), as the server's step phases count it
        self.frame_received_at = 0.0

    async def receive_frame(self, max_bytes: int) -> dict[str, Any] | None:
        """The next frame, or None when the peer ended the stream (also in the middle of a frame: what
        it sent of that one is dropped). ProtocolError for a frame we refuse: after a too_large one
        the unread body is still in the stream, so the caller answers and ends it. PeerUnavailableError
        if the stream is lost."""
        try:
            body = await read_frame_body(self.reader, max_bytes)
        except asyncio.IncompleteReadError:
            return None
        except (P2PDaemonError, ConnectionError) as exc:
            raise _unavailable(self.peer, "", f"stream lost: {exc!r}") from exc
        self.frame_received_at = time.perf_counter()
        return unpack(body)

    async def send(self, message: Message, timeout_s: float | None = None) -> None:
        """Write one frame; with `timeout_s`, give up (and close the stream) if the peer does not take
        it in time. PeerUnavailableError (code timeout for that) if it cannot be written."""
        wire = message.to_wire()
        try:
            async with asyncio.timeout(timeout_s), self._writing:
                await write_frame(self.writer, wire)
        except TimeoutError as exc:
            self.close()
            raise _unavailable(self.peer, "", f"did not take a frame within {timeout_s:.0f} s",
                               ErrorCode.TIMEOUT) from exc
        except _SEND_FAILURES as exc:
            raise _unavailable(self.peer, "", f"stream lost: {exc!r}") from exc

    def close(self) -> None:
        """End the stream (idempotent); the peer's reads end, and so does our handler's loop."""
        self.writer.close()


StreamHandler = Callable[[IncomingStream], Awaitable[None]]


async def serve(p2p: P2P, protocol: str, handler: StreamHandler) -> None:
    """Answer streams opened to us for `protocol`: handler(the stream, which names its peer)."""

    async def on_stream(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await handler(IncomingStream(info.peer_id.to_base58(), reader, writer))

    await p2p.add_binary_stream_handler(protocol, on_stream)


async def stop_serving(p2p: P2P, protocol: str) -> None:
    await p2p.remove_binary_stream_handler(protocol)
