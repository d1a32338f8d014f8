"""The WAN benchmark's delay proxy: no chunk goes out before its due time, bytes arrive intact and
in order, and how late each chunk went out is counted (what the benchmark reports beside its floors)."""

import asyncio
import time

from benchmarks.delay_proxy import ProxyRoute, ProxyThread, free_port

DELAY_S = 0.03


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trips(route: ProxyRoute, messages: list[bytes]) -> list[tuple[float, bytes]]:
    """Each message sent through the proxy to an echo server and back: (seconds, what came back)."""
    server = await asyncio.start_server(_echo, "127.0.0.1", route.target_port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", route.listen_port)
        results = []
        for message in messages:
            started = time.monotonic()
            writer.write(message)
            echoed = await reader.readexactly(len(message))
            results.append((time.monotonic() - started, echoed))
        writer.close()
        return results
    finally:
        server.close()


def test_chunks_are_delayed_both_ways_intact_and_their_lateness_counted():
    route = ProxyRoute(free_port(), free_port())
    messages = [bytes([i]) * size for i, size in enumerate((1, 1000, 200_000, 5))]
    with ProxyThread([route], DELAY_S) as proxies:
        results = asyncio.run(_round_trips(route, messages))
        counts = proxies.proxies[0].counts
        lateness = counts.lateness()
    assert [echoed for _, echoed in results] == messages
    assert all(rtt >= 2 * DELAY_S for rtt, _ in results), [rtt for rtt, _ in results]
    total = sum(map(len, messages))
    assert sum(counts.up.values()) == sum(counts.down.values()) == total
    assert lateness["chunks"] >= 2 * len(messages)  # each message, each way, in at least one chunk
    assert lateness["max_us"] >= lateness["mean_us"] >= lateness["min_us"] >= 0.0  # none went out early
