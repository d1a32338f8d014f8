"""A server's memory stays bounded over many sessions: after 200 sessions opened, stepped and closed
(by the client, by a disconnect, by the idle timeout), its RSS is within a stated bound of its RSS
after the first 10, and its whole cache budget is free again.

The sessions are driven by a light client speaking the wire protocol (no model, no LM head), ten at
a time, so the peak number of open sessions, and with it what the allocator keeps, is the same in
both phases. Each session reserves 1 MiB of cache (4 blocks x keys and values x 512 positions x
hidden 64 x float32), all of it written by torch.zeros. The bound, 24 MiB, is about twice what the
allocator was seen to keep in fragments (RSS after 10, 50, 100 ... 500 sessions: 415.7, 426.3,
422.5, 423.3, 422.6, 424.0, 426.9 MiB): each of the three ways a session ends is a quarter of the
190 later sessions, so a leak on any one of them (47 MiB) fails the test.
"""

import asyncio
import itertools

import torch

from bloompeer.p2p import INFERENCE_PROTOCOL, CloseSession, OpenSession, Step, read_frame, write_frame
from tests.wire import raw_stream, server_info

FIRST, TOTAL, AT_ONCE = 10, 200, 10
MAX_LENGTH, PROMPT, STEPS = 512, 8, 3
RSS_BOUND_MIB = 24  # allowed growth from after 10 sessions to after 200 (a leaked session holds 1 MiB)
HIDDEN = 64


def rss_mib(pid: int) -> float:
    """The process's resident set (VmRSS) now."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


async def _until_all_freed(node, server, cache_tokens: int, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        info = await server_info(node, server)
        if info.sessions == 0 and info.cache_tokens_left == cache_tokens:
            return
        assert loop.time() < deadline, f"not freed within {timeout_s:.0f} s: {info}"
        await asyncio.sleep(0.05)


async def _one_session(node, server, model_uid: str, index: int) -> str:
    """Open, step (a prompt, then single tokens), then end the session one of three ways."""
    reader, writer = await raw_stream(node, server, INFERENCE_PROTOCOL)
    try:
        await write_frame(writer, OpenSession(model_uid, 0, 4, 1, MAX_LENGTH, 60.0).to_wire())
        reply = await asyncio.wait_for(read_frame(reader), 90)
        assert reply["type"] == "ready", reply
        generator = torch.Generator().manual_seed(index)
        position = 0
        for step_id, num_new in enumerate([PROMPT] + [1] * STEPS, 1):
            hidden = torch.randn(1, num_new, HIDDEN, generator=generator)
            await write_frame(writer, Step(position, hidden, step_id=step_id).to_wire())
            reply = await asyncio.wait_for(read_frame(reader), 30)
            assert reply["type"] == "output" and reply["step_id"] == step_id, reply
            position += num_new
        ending = ("timeout", "disconnect", "close", "close")[index % 4]
        if ending == "close":
            await write_frame(writer, CloseSession().to_wire())
        elif ending == "timeout":  # stay connected, silent: the server ends the stream after its timeout
            try:
                extra = await asyncio.wait_for(read_frame(reader), 30)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            else:
                raise AssertionError(f"an idle session got a frame instead of its end: {extra}")
        return ending  # "disconnect": the stream just closes, below
    finally:
        writer.close()


async def _sessions(node, server, model_uid: str, indices) -> list[str]:
    limit = asyncio.Semaphore(AT_ONCE)

    async def limited(index: int) -> str:
        async with limit:
            return await _one_session(node, server, model_uid, index)

    return await asyncio.gather(*(limited(index) for index in indices))


async def test_rss_after_200_sessions_stays_near_rss_after_10(node, start_servers, fresh_model):
    cache_tokens = AT_ONCE * MAX_LENGTH  # room for exactly AT_ONCE sessions: opens also wait for room
    (server,) = start_servers([(0, 4)], "--session-timeout", "1", "--cache-tokens", str(cache_tokens),
                              "--max-sessions-per-peer", str(2 * AT_ONCE), "--max-length", str(MAX_LENGTH))
    indices = itertools.count()
    endings = await _sessions(node, server, fresh_model.name, itertools.islice(indices, FIRST))
    await _until_all_freed(node, server, cache_tokens)
    after_first = rss_mib(server.pid)
    endings += await _sessions(node, server, fresh_model.name, itertools.islice(indices, TOTAL - FIRST))
    await _until_all_freed(node, server, cache_tokens)
    after_all = rss_mib(server.pid)
    assert len(endings) == TOTAL and {endings.count(kind) for kind in ("timeout", "disconnect")} == {TOTAL // 4}
    print(f"server RSS after {FIRST} sessions: {after_first:.1f} MiB, after {TOTAL}: {after_all:.1f} MiB "
          f"({after_all - after_first:+.1f} MiB)")
    assert after_all - after_first <= RSS_BOUND_MIB, (
        f"the server's RSS grew by {after_all - after_first:.1f} MiB from {FIRST} to {TOTAL} sessions "
        f"({after_first:.1f} -> {after_all:.1f} MiB): more than {RSS_BOUND_MIB} MiB, a leak")
