"""p2p/streams.py turns whatever goes wrong on a stream into bloompeer's errors: checked on real
asyncio streams over loopback TCP (libp2p streams are asyncio streams too), against a peer that
answers, answers an error, answers garbage, goes silent, or hangs up; and on the server's end
(IncomingStream), against a client that ends its stream, hangs up, sends too much or stops reading."""

import asyncio
import itertools

import pytest
import torch

from bloompeer.p2p import (
    ErrorCode, ErrorFrame, IncomingStream, PeerBusyError, PeerMisbehavedError, PeerStream, PeerUnavailableError,
    ProtocolError, StepOutput, request_once, write_frame,
)
from bloompeer.p2p.framing import HEADER_BYTES

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


async def _peer(behaviour):
    """A loopback peer that runs behaviour(reader, writer) for the stream, and a PeerStream to it."""
    server = await asyncio.start_server(behaviour, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return server, PeerStream("peer-a", reader, writer, timeout_s=0.5, about="blocks 0:2")


async def _receive_from(behaviour):
    server, stream = await _peer(behaviour)
    try:
        return await stream.receive(StepOutput)
    finally:
        await stream.close()
        server.close()


async def test_an_answer_is_decoded():
    async def answer(reader, writer):
        await write_frame(writer, StepOutput(torch.ones(1, 2, 3), step_id=7).to_wire())

    reply = await _receive_from(answer)
    assert reply.step_id == 7 and torch.equal(reply.hidden, torch.ones(1, 2, 3))


async def test_an_error_frame_raises_the_class_of_its_code():
    async def busy(reader, writer):
        await write_frame(writer, ErrorFrame(ErrorCode.BUSY, "no room").to_wire())

    with pytest.raises(PeerBusyError) as raised:
        await _receive_from(busy)
    assert raised.value.peer == "peer-a" and "blocks 0:2: no room" in str(raised.value)


async def _silent(reader, writer):
    """Says nothing until the other side hangs up (so it is silent however late the timeout fires)."""
    await reader.read()
    writer.close()


async def test_silence_is_a_timeout():
    silent = _silent

    with pytest.raises(PeerUnavailableError) as raised:
        await _receive_from(silent)
    assert raised.value.code is ErrorCode.TIMEOUT and "no answer within" in str(raised.value)


async def test_a_hang_up_mid_frame_is_a_lost_stream():
    async def hang_up(reader, writer):
        writer.write((100).to_bytes(HEADER_BYTES, "big") + b"only part")
        await writer.drain()
        writer.close()

    with pytest.raises(PeerUnavailableError, match="stream lost"):
        await _receive_from(hang_up)


@pytest.mark.parametrize("frame", [
    {"type": "output", "hidden": "not a tensor", "step_id": 1},  # ill-typed field
    {"type": "session_ready", "session_id": "x"},  # a message we did not ask for
    {"type": "output", "hidden": {"dtype": "float32", "shape": [1 << 63, 0], "codec": "raw", "data": b""}},
    {"type": "output", "hidden": {"dtype": "float32", "shape": [1 << 62, 1 << 62, 0], "codec": "raw", "data": b""}},
    {"type": "output", "hidden": [[]] * 5000},  # over the items a frame may make
])
async def test_a_reply_we_cannot_accept_is_misbehaviour(frame):
    async def garbage(reader, writer):
        await write_frame(writer, frame)

    with pytest.raises(PeerMisbehavedError) as raised:
        await _receive_from(garbage)
    assert "sent an invalid reply" in str(raised.value)


async def test_sending_to_a_closed_stream_is_a_lost_stream():
    async def hang_up_at_once(reader, writer):
        writer.close()

    server, stream = await _peer(hang_up_at_once)
    try:
        with pytest.raises(PeerUnavailableError, match="stream lost"):
            for _ in range(50):  # the first writes may still land in socket buffers
                await stream.send(StepOutput(torch.zeros(1, 256, 64)))
                await asyncio.sleep(0.01)
    finally:
        await stream.close()  # never raises, the stream being gone
        server.close()


class _LoopbackP2P:
    """What request_once needs of hivemind's P2P: each stream it opens is a new loopback connection."""

    def __init__(self, port: int):
        self.port, self.opened = port, 0

    async def call_binary_stream_handler(self, peer_id, protocol):
        self.opened += 1
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        return None, reader, writer


async def _request_once(behaviour, request):
    """request_once against a peer that runs behaviour(stream number, reader, writer) for each stream."""
    streams = itertools.count()
    server = await asyncio.start_server(lambda reader, writer: behaviour(next(streams), reader, writer),
                                        "127.0.0.1", 0)
    p2p = _LoopbackP2P(server.sockets[0].getsockname()[1])
    try:
        return await request_once(p2p, PEER, "/test", request, StepOutput, 0.5, "ping"), p2p.opened
    except PeerUnavailableError as exc:
        return exc, p2p.opened
    finally:
        server.close()


async def _lose_the_first_stream(number, reader, writer):
    if number:
        await write_frame(writer, StepOutput(torch.ones(1, 1, 2), step_id=3).to_wire())
    writer.close()


async def test_a_stream_lost_before_a_peer_that_speaks_first_spoke_is_opened_once_more():
    reply, opened = await _request_once(_lose_the_first_stream, None)
    assert reply.step_id == 3 and opened == 2


async def test_a_request_on_a_lost_stream_is_not_sent_again():
    """The peer may have acted on it: whether to ask again is the caller's decision."""
    error, opened = await _request_once(_lose_the_first_stream, StepOutput(torch.ones(1, 1, 2)))
    assert isinstance(error, PeerUnavailableError) and "stream lost" in str(error) and opened == 1


async def test_a_silent_peer_is_not_asked_twice():
    async def silent(number, reader, writer):
        await _silent(reader, writer)

    error, opened = await _request_once(silent, None)
    assert error.code is ErrorCode.TIMEOUT and opened == 1


async def _incoming(client):
    """A loopback stream whose far end runs client(reader, writer), and its near end as a server's
    handler gets it (an IncomingStream)."""
    accepted = asyncio.get_running_loop().create_future()
    server = await asyncio.start_server(lambda reader, writer: accepted.set_result((reader, writer)), "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    peer = asyncio.create_task(client(reader, writer))
    return server, peer, IncomingStream("client-a", *await accepted)


async def test_an_incoming_stream_reads_frames_until_its_peer_ends_it():
    async def two_frames_then_end(reader, writer):
        for step_id in (1, 2):
            await write_frame(writer, {"type": "x", "step_id": step_id})
        writer.write((100).to_bytes(HEADER_BYTES, "big") + b"a frame cut short")  # then the end: dropped
        writer.close()

    server, peer, stream = await _incoming(two_frames_then_end)
    try:
        frames = [await stream.receive_frame(1 << 20) for _ in range(3)]
        assert frames == [{"type": "x", "step_id": 1}, {"type": "x", "step_id": 2}, None]
    finally:
        stream.close()
        server.close()
        await peer


async def test_an_incoming_frame_over_the_limit_is_refused_unread():
    async def too_large(reader, writer):
        await write_frame(writer, {"data": bytes(1000)})
        await reader.read()  # until the server ends the stream

    server, peer, stream = await _incoming(too_large)
    try:
        with pytest.raises(ProtocolError) as raised:
            await stream.receive_frame(100)
        assert raised.value.code is ErrorCode.TOO_LARGE
    finally:
        stream.close()
        server.close()
        await peer


async def test_answering_a_client_that_hung_up_is_a_lost_stream():
    async def hang_up(reader, writer):
        writer.close()

    server, peer, stream = await _incoming(hang_up)
    await peer
    try:
        with pytest.raises(PeerUnavailableError, match="stream lost") as raised:
            for _ in range(50):  # the first writes may still land in socket buffers
                await stream.send(StepOutput(torch.zeros(1, 256, 64)))
                await asyncio.sleep(0.01)
        assert raised.value.peer == "client-a"
    finally:
        stream.close()
        server.close()


async def test_an_answer_the_client_does_not_take_in_time_ends_the_stream():
    async def stops_reading(reader, writer):
        await asyncio.sleep(30)

    server, peer, stream = await _incoming(stops_reading)
    try:
        with pytest.raises(PeerUnavailableError) as raised:
            for _ in range(1000):  # until the socket buffers are full and a frame waits
                await stream.send(StepOutput(torch.zeros(1, 256, 256)), timeout_s=0.2)
        assert raised.value.code is ErrorCode.TIMEOUT and stream.writer.is_closing()
    finally:
        stream.close()
        server.close()
        peer.cancel()
