"""A server under load, over the wire: a bounded cache reserved at open, waits and clear refusals,
sessions freed on close, disconnect and idleness, per-peer limits.

Sessions close after idling on a server of their own (`idle_server`): on the other one, a session a
test holds open while it opens others must not be closed under it, however slow the machine."""

import asyncio
import shutil

import pytest

from bloompeer.p2p import ErrorCode, OpenSession, read_frame, write_frame
from tests.wire import raw_stream, server_info

CACHE_TOKENS = 64
MODEL_UID = "limited-bloom"
IDLE_MODEL_UID = "idle-bloom"


def _limited(swarm, tiny_checkpoint, tmp_path_factory, model_uid: str, *args: str):
    """A server of a model name of its own (so no other test routes to it) with small limits."""
    model = tmp_path_factory.mktemp(model_uid) / model_uid
    shutil.copytree(tiny_checkpoint, model)
    return swarm.add_server(0, 4, model=model, name=model_uid, extra_args=[
        "--cache-tokens", str(CACHE_TOKENS), "--max-sessions-per-peer", "3", *args])


@pytest.fixture(scope="module")
def limited_server(swarm, tiny_checkpoint, tmp_path_factory):
    server = _limited(swarm, tiny_checkpoint, tmp_path_factory, MODEL_UID)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def idle_server(swarm, tiny_checkpoint, tmp_path_factory):
    """One whose sessions close after 2 s without a step."""
    server = _limited(swarm, tiny_checkpoint, tmp_path_factory, IDLE_MODEL_UID, "--session-timeout", "2")
    yield server
    server.stop()


async def _open(node, server, max_length, alloc_timeout_s=0.0, model_uid=MODEL_UID):
    reader, writer = await raw_stream(node, server)
    await write_frame(writer, OpenSession(model_uid, 0, 4, 1, max_length, alloc_timeout_s).to_wire())
    return reader, writer, await asyncio.wait_for(read_frame(reader), 30)


async def _until(predicate, timeout_s=60.0):
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
    waiting = asyncio.ensure_future(_open(node, limited_server, max_length=32, alloc_timeout_s=60))
    # a round trip through the server since: the waiting open has taken no room, nor been answered
    assert (await server_info(node, limited_server)).cache_tokens_left == CACHE_TOKENS - 48
    assert not waiting.done()
    first_writer.close()  # the client goes away: its session is freed, the waiting open gets the room
    _, writer, reply = await asyncio.wait_for(waiting, 60)
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


async def test_idle_sessions_are_closed_after_the_timeout(node, idle_server):
    reader, writer, reply = await _open(node, idle_server, max_length=16, model_uid=IDLE_MODEL_UID)
    assert reply["type"] == "ready"
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
        await asyncio.wait_for(read_frame(reader), 60)  # the server ends the stream after 2 s idle (60: a guard)
    writer.close()
    await _until(lambda: _full(node, idle_server))


async def test_sessions_per_peer_are_limited(node, limited_server):
    opened = [await _open(node, limited_server, max_length=8) for _ in range(3)]
    assert all(reply["type"] == "ready" for _, _, reply in opened)
    _, writer, reply = await _open(node, limited_server, max_length=8)
    assert reply["code"] == ErrorCode.BUSY.value and "per peer" in reply["message"]
    for _, other_writer, _ in opened + [(None, writer, None)]:
        other_writer.close()
    await _until(lambda: _full(node, limited_server))
