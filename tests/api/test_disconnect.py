"""A client that leaves mid-stream stops its generation: the servers' caches are free again at once
(as each server reports its cache room), long before the generation could have finished. And a client
that gives up on a request still waiting for the swarm (here for servers of blocks the API may not
use) has that work cancelled: the API's thread is free again at once, not when the wait ends."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.wire import server_info

from .conftest import gauge, scrape, start_waiting_api

MAX_TOKENS = 4000  # minutes of generation: it can only end this soon if the disconnect stopped it


async def _rooms(node, servers) -> list[tuple[int, int]]:
    """(cache tokens left, open sessions) of each server."""
    return [(info.cache_tokens_left, info.sessions) for info in [await server_info(node, s) for s in servers]]


async def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.25)


async def _generations(api) -> dict[str, float]:
    samples = await asyncio.to_thread(scrape, api)
    counts = {dict(labels)["reason"]: value for (name, labels), value in samples.items()
              if name == "bloompeer_api_generations_total"}
    return counts | {"tokens": sum(value for (name, _), value in samples.items()
                                   if name == "bloompeer_api_generated_tokens_total")}


async def _idle_rooms(node, servers) -> list[tuple[int, int]]:
    """The servers' rooms once no session is open on them: a session of an earlier test (closed by
    its client, its stream still ending) is waited for, not taken for this test's."""
    async def idle() -> bool:
        return all(sessions == 0 for _, sessions in await _rooms(node, servers))

    await _until(idle, "no session left on the shared swarm's servers")
    return await _rooms(node, servers)


async def test_a_disconnect_mid_stream_frees_the_servers_caches(api, swarm, node, model_id):
    servers = swarm.servers[:2]  # the shared swarm's own servers: blocks 0:2 and 2:4
    idle = await _idle_rooms(node, servers)
    before = await _generations(api)

    async with api.async_client() as client:
        stream = await client.completions.create(model=model_id, prompt="Leaving soon", max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True)
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break
        busy = await _rooms(node, servers)
        assert all(sessions == 1 and room < idle_room for (room, sessions), (idle_room, _) in zip(busy, idle)), busy
        await stream.close()  # the HTTP client goes away

        await _until(lambda: _freed(node, servers, idle), "the servers' caches are free again")
    await _counted_once_more(api, before)


async def _freed(node, servers, idle) -> bool:
    return await _rooms(node, servers) == idle


async def _counted_once_more(api, before: dict[str, float]) -> None:
    """The API counts the generation as ended by a disconnect (once its task has seen the end, which
    may come just after the servers freed their caches), and far short of MAX_TOKENS."""
    async def counted() -> bool:
        return (await _generations(api)).get("disconnect", 0) > before.get("disconnect", 0)

    await _until(counted, "the API counts a disconnect")
    after = await _generations(api)
    assert after.get("disconnect", 0) == before.get("disconnect", 0) + 1
    assert after["tokens"] - before["tokens"] < MAX_TOKENS


async def test_a_plain_request_whose_client_gives_up_stops_too(api, swarm, node, model_id):
    """The client leaves once its generation holds sessions on both servers (not after a time of its
    own, which a slow machine might spend before the generation even began)."""
    servers = swarm.servers[:2]
    idle = await _idle_rooms(node, servers)
    before = await _generations(api)

    async def generating() -> bool:
        return all(sessions == 1 for _, sessions in await _rooms(node, servers))

    async with api.async_client() as client:
        waiting = asyncio.ensure_future(client.completions.create(model=model_id, prompt="Never mind",
                                                                  max_tokens=MAX_TOKENS, temperature=0))
        await _until(generating, "the generation holds a session on each server")
        waiting.cancel()  # the HTTP client goes away
        with pytest.raises(asyncio.CancelledError):
            await waiting
    await _until(lambda: _freed(node, servers, idle), "the servers' caches are free again")
    await _counted_once_more(api, before)


@pytest.mark.parametrize("work", ["generation", "scoring"])
async def test_a_client_that_gives_up_on_a_request_waiting_for_the_swarm_stops_its_work(swarm, tiny_checkpoint,
                                                                                         tmp_path, work):
    """The request waits for servers of blocks 2:4 (up to ten minutes): a generation's first step, or a
    scoring pass's forward (echo with logprobs, max_tokens 0: no session). Both must stop when the
    client leaves; before, only a flag was set, read once the step or forward returned."""
    api = await asyncio.to_thread(start_waiting_api, swarm, tiny_checkpoint, tmp_path)
    try:
        request = {"generation": dict(prompt="Waiting", max_tokens=8),
                   "scoring": dict(prompt="Waiting", max_tokens=0, echo=True, logprobs=1)}[work]
        async with api.async_client() as client:
            waiting = asyncio.ensure_future(client.completions.create(model=tiny_checkpoint.name, temperature=0,
                                                                      **request))
            await _until(lambda: _busy_threads(api, 1), "the request's work is on a thread, waiting for the swarm")
            waiting.cancel()  # the HTTP client goes away
            with pytest.raises(asyncio.CancelledError):
                await waiting
        await _until(lambda: _busy_threads(api, 0), "the request's work stops")
        # counted as ended by the request's handler on the event loop, which may run just after the thread
        # is free: waited for (a generation never counted as ended fails here)
        await _until(_no_generation_in_progress(api), "the request counted as ended")
    finally:
        await asyncio.to_thread(api.stop)


def _no_generation_in_progress(api):
    async def check() -> bool:
        return await asyncio.to_thread(gauge, api, "bloompeer_api_generations_in_progress") == 0

    return check


async def _busy_threads(api, expected: int) -> bool:
    return await asyncio.to_thread(gauge, api, "bloompeer_api_busy_threads") == expected
