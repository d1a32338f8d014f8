import asyncio

import msgpack
import pytest

from bloompeer.p2p import ErrorCode, ProtocolError, pack, read_frame, unpack, write_frame


def test_pack_unpack_round_trip():
    message = {"type": "step", "position": 3, "data": b"\x00\x01", "nested": {"a": [1, 2.5, None]}}
    assert unpack(pack(message)) == message


@pytest.mark.parametrize("payload", [
    msgpack.packb(msgpack.ExtType(1, b"x")),  # ext types (hivemind uses them for tuples and pickled values)
    msgpack.packb({"a": msgpack.ExtType(42, b"\x80\x04")}),
    msgpack.packb([1, 2, 3]),  # not a map
    msgpack.packb({1: "int keys"}),
    b"\xc1",  # never-used msgpack byte
    msgpack.packb({"a": 1}) + b"trailing",
    b"",
])
def test_unpack_refuses_non_plain_maps(payload):
    with pytest.raises(ProtocolError):
        unpack(payload)


async def _reader_with(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_read_frame_checks_length_before_reading_the_body():
    header = (1 << 40).to_bytes(8, "big")  # announces 1 TiB and sends nothing more
    with pytest.raises(ProtocolError) as info:
        await read_frame(await _reader_with(header), max_bytes=1 << 20)
    assert info.value.code is ErrorCode.TOO_LARGE


async def test_write_then_read_frame():
    class Sink:
        def __init__(self):
            self.data = b""

        def write(self, chunk):
            self.data += chunk

        async def drain(self):
            pass

    sink = Sink()
    await write_frame(sink, {"type": "close"})
    assert await read_frame(await _reader_with(sink.data)) == {"type": "close"}


async def test_truncated_frame_is_end_of_stream():
    payload = pack({"type": "close"})
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(await _reader_with(len(payload).to_bytes(8, "big") + payload[:-1]))
