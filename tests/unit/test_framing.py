import asyncio

import msgpack
import pytest
import torch

from bloompeer.p2p import (
    MAX_PUSH_RTTS, ErrorCode, ProtocolError, PushStep, PushTarget, RequestLimits, ServerRecord,
    ServerState, Step, decode_message, pack, read_frame, unpack, write_frame,
)
from bloompeer.p2p.framing import MAX_FRAME_ITEMS
from bloompeer.p2p.messages import MAX_PUSH_HOPS
from bloompeer.p2p.records import MAX_RELAY_MADDRS
from bloompeer.weight_format import WeightFormat


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


def _items_bomb(count: int, empty: bytes) -> bytes:
    """{"a": [<empty>, <empty>, ...]}: one byte per item, so a few MiB make millions of objects."""
    return b"\x81\xa1a\xdd" + count.to_bytes(4, "big") + empty * count


@pytest.mark.parametrize("payload", [
    _items_bomb(1 << 20, b"\x90"),  # a million empty arrays
    _items_bomb(1 << 20, b"\x80"),  # a million empty maps
    _items_bomb(MAX_FRAME_ITEMS, b"\x01"),  # one array of ints, one item too many with the map around it
    b"\x81\xa1a\xdc\x01\x00" + (b"\xdc\x01\x00" + b"\x90" * 256) * 256,  # 256 x 256 arrays: none long, many in all
    msgpack.packb({f"k{i}": i for i in range(MAX_FRAME_ITEMS)}),  # a map of too many pairs
    b"\x81\xa1a\xdd\xff\xff\xff\xff",  # an array announcing 4 G items, and none there
])
def test_unpack_bounds_the_items_a_frame_makes(payload):
    with pytest.raises(ProtocolError) as info:
        unpack(payload)
    assert info.value.code is ErrorCode.BAD_REQUEST


def test_the_largest_real_frames_fit_the_item_bound():
    """Every hop of the longest push chain, with every optional tensor: well under MAX_FRAME_ITEMS."""
    hops = tuple(PushTarget(f"peer{i}", f"session{i}") for i in range(MAX_PUSH_HOPS))
    step = Step(0, torch.zeros(2, 3, 8), torch.ones(2, 3, dtype=torch.bool), torch.tensor([1, 0]), 7, hops,
                torch.zeros(2, 2, 3, 8))
    assert decode_message(unpack(pack(step.to_wire())), Step).push == hops
    assert decode_message(unpack(pack(PushStep("s", step).to_wire())), PushStep).step.push == hops
    limits = RequestLimits(max_batch=64, max_length=8192, max_step_tokens=65536)
    peer = "12D3KooW" + "a" * 44
    record = ServerRecord(peer, ServerState.ONLINE, 0, 4, 1.0, 1, WeightFormat(), "0.1.0", "ab", True, limits,
                          push_rtts_s=tuple((f"{peer}{i:02d}", 0.5) for i in range(MAX_PUSH_RTTS)),
                          relay_maddrs=(f"/ip4/10.0.0.1/tcp/4000/p2p/{peer}",) * MAX_RELAY_MADDRS,
                          via_relays=(f"/ip6/::1/udp/4001/quic-v1/p2p/{peer}/p2p-circuit",) * MAX_RELAY_MADDRS)
    assert ServerRecord.from_wire(unpack(pack(record.to_wire()))) == record
