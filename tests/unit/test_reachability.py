"""p2p/reachability.py over loopback TCP: a helper answers a dialback request with the requester's
addresses that accept a connection, refuses a malformed one with bad_request (and goes on), and a
requester believes a helper about the addresses it asked about only."""

import asyncio
from types import SimpleNamespace

import pytest

from bloompeer.p2p import ErrorCode, pack, read_frame, write_frame
from bloompeer.p2p.reachability import (
    DialbackRequest, DialbackResult, _handle_dialback, reachable_maddrs,
)

HELPER = "12D3KooW" + "H" * 44


class LoopbackP2P:
    """Opens every stream to a local asyncio server that runs `answer(reader, writer)`: the one
    thing reachable_maddrs asks of hivemind's P2P."""

    def __init__(self, answer):
        self.answer, self.servers = answer, []

    async def call_binary_stream_handler(self, peer_id, protocol):
        server = await asyncio.start_server(self.answer, "127.0.0.1", 0)
        self.servers.append(server)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        return None, reader, writer

    def close(self):
        for server in self.servers:
            server.close()


async def _dialback(frame_bytes: bytes) -> dict:
    """Send one raw frame body to the dialback handler as a peer on 127.0.0.1 would; its answer."""
    info = SimpleNamespace(addr="/ip4/127.0.0.1/tcp/50000")
    server = await asyncio.start_server(lambda r, w: _handle_dialback(info, r, w), "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        writer.write(len(frame_bytes).to_bytes(8, "big") + frame_bytes)
        await writer.drain()
        reply = await asyncio.wait_for(read_frame(reader), 10)
        writer.close()
        return reply
    finally:
        server.close()


async def _listening_port() -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_the_helper_reports_the_open_addresses_on_the_requesters_ip():
    server, port = await _listening_port()
    closed_server, closed = await _listening_port()
    closed_server.close()
    await closed_server.wait_closed()
    try:
        asked = [f"/ip4/127.0.0.1/tcp/{port}", f"/ip4/127.0.0.1/tcp/{closed}", f"/ip4/10.9.9.9/tcp/{port}"]
        reply = await _dialback(pack(DialbackRequest(tuple(asked)).to_wire()))
    finally:
        server.close()
    assert reply == {"type": "dialback_result", "reachable": [f"/ip4/127.0.0.1/tcp/{port}"]}


@pytest.mark.parametrize("maddrs", [
    ["/ip4/127.0.0.1/tcp/99999"], ["/ip4/127.0.0.1/tcp/0"], ["/ip4/127.0.0.1/tcp/-1"], ["/ip4/127.0.0.1/tcp/²"],
    ["/ip4/127.0.0.1/tcp/1_000"], ["/ip4/127.0.0.1/tcp"], ["not a multiaddr"], ["/ip4/127.0.0.1/tcp/80/ws"],
    ["/ip6/::1%lo/tcp/80"],
])
async def test_a_malformed_address_is_a_bad_request(maddrs):
    reply = await _dialback(pack({"type": "dialback", "maddrs": maddrs}))
    assert (reply["type"], reply["code"]) == ("error", ErrorCode.BAD_REQUEST.value)


async def test_a_helper_cannot_make_us_announce_addresses_we_did_not_ask_about():
    ours = ["/ip4/203.0.113.5/tcp/31337", "/ip4/203.0.113.5/udp/31337/quic-v1"]

    async def lying_helper(reader, writer):
        await read_frame(reader)
        claimed = [ours[0], "/ip4/198.51.100.66/tcp/6666", f"{ours[1]}/p2p/{HELPER}"]
        await write_frame(writer, DialbackResult(tuple(claimed)).to_wire())

    p2p = LoopbackP2P(lying_helper)
    try:
        assert await reachable_maddrs(p2p, [HELPER], ours) == ([ours[0]], HELPER)
    finally:
        p2p.close()


async def test_we_ask_about_plain_addresses_only():
    """What a helper would refuse (the whole request) is not asked: the other addresses still are."""
    asked = []

    async def helper(reader, writer):
        request = DialbackRequest.from_wire(await read_frame(reader))
        asked.extend(request.maddrs)
        await write_frame(writer, DialbackResult(request.maddrs).to_wire())

    ours = ["/ip4/203.0.113.5/tcp/31337", "/ip4/203.0.113.5/tcp/31337/ws", "/ip6/fe80::1%eth0/tcp/1"]
    p2p = LoopbackP2P(helper)
    try:
        assert await reachable_maddrs(p2p, [HELPER], ours) == ([ours[0]], HELPER)
    finally:
        p2p.close()
    assert asked == [ours[0]]
