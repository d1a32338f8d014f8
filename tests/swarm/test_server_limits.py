"""A server under load, over the wire: a bounded cache reserved at open, waits and clear refusals,
sessions freed on close, disconnect and idleness, per-peer limits."""

import asyncio
import shutil

import pytest

from bloompeer.p2p import ErrorCode, OpenSession, read_frame, write_frame
from tests.wire import raw_stream, server_info

CACHE_TOKENS = 64
MODEL_UID = "limited-bloom"


@pytest.fixture(scope="module")
def limited_server(swarm, tiny_checkpoint, tmp_path_factory):
    """A server of its own model name (so no other test routes to it) with small limits."""
    model = tmp_path_factory.mktemp("limits") / MODEL_UID
    shutil.copytree(tiny_checkpoint, model)
    server = swarm.add_server(0, 4, model=model, name="limited", extra_args=[
        "--cache-tokens", str(CACHE_TOKENS), "--session-timeout", "2", "--max-sessions-per-peer", "3"])
    yield server
    server.stop()


async def _open(node, server, max_length, alloc_timeout_s=0.0):
    reader, writer = await raw_stream(node, server)
    await write_frame(writer, OpenSession(MODEL_UID, 0, 4, 1, max_length, alloc_timeout_s).to_wire())
    return reader, writer, await asyncio.wait_for(read_frame(reader), 30)


async def _until(predicate, timeout_s=10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_cache_is_reserved_at_open_and_a_full_server_says_how_full(node, limited_server):
    _, first_writer, reply = await _open(node, limited_server, max_length=48)
    assert reply["type"] == "ready"
    assert (await server_info(node, limited_server)).cache_tokens_left == CACHE_TOKENS - 48
    _, _, refused = await _open(node, limited_server, max_length=32, alloc_timeout_s=0.3)
    assert refused["code"] == ErrorCode.BUSY.value
    assert "asked for 32 tokens" in refused["message"] and f"16 of {CACHE_TOKENS}" in refused["message"]
    waiting = asyncio.ensure_future(_open(node, limited_server, max_length=32, alloc_timeout_s=20))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    first_writer.close()  # the client goes away: its session is freed, the waiting open gets the room
    _, writer, reply = await asyncio.wait_for(waiting, 20)
    assert reply["type"] == "ready"
    writer.close()
    await _until(lambda: _full(node, limited_server))


async def _full(node, server) -> bool:
    info = await server_info(node, server)
    return info.cache_tokens_left == CACHE_TOKENS and info.sessions == 0


async def test_never_fits_is_refused_at_once(node, limited_server):
    _, writer, reply = await _open(node, limited_server, max_length=CACHE_TOKENS + 1, alloc_timeout_s=30)
    writer.close()
    assert reply["code"] == ErrorCode.TOO_LARGE.value


async def test_idle_sessions_are_closed_after_the_timeout(node, limited_server):
    reader, writer, reply = await _open(node, limited_server, max_length=16)
    assert reply["type"] == "ready"
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
        await asyncio.wait_for(read_frame(reader), 15)  # the server ends the stream after 2 s idle
    writer.close()
    await _until(lambda: _full(node, limited_server))


async def test_sessions_per_peer_are_limited(node, limited_server):
    opened = [await _open(node, limited_server, max_length=8) for _ in range(3)]
    assert all(reply["type"] == "ready" for _, _, reply in opened)
    _, writer, reply = await _open(node, limited_server, max_length=8)
    assert reply["code"] == ErrorCode.BUSY.value and "per peer" in reply["message"]
    for _, other_writer, _ in opened + [(None, writer, None)]:
        other_writer.close()
    await _until(lambda: _full(node, limited_server))
