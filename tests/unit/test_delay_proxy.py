"""The WAN benchmark's delay proxy: no chunk goes out before its due time, bytes arrive intact and
in order, and how late each chunk went out is counted (what the benchmark reports beside its floors)."""

import asyncio
import threading
import time

from benchmarks.delay_proxy import ProxyRoute, ProxyThread, free_port

DELAY_S = 0.03


def _echo_server(port: int) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    ready = threading.Event()

    def run() -> None:
        loop.run_until_complete(asyncio.start_server(echo, "127.0.0.1", port))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    return loop, thread


async def _round_trips(port: int, messages: list[bytes]) -> list[tuple[float, bytes]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    results = []
    for message in messages:
        started = time.monotonic()
        writer.write(message)
        echoed = await reader.readexactly(len(message))
        results.append((time.monotonic() - started, echoed))
    writer.close()
    return results


def test_chunks_are_delayed_both_ways_intact_and_their_lateness_counted():
    target, listen = free_port(), free_port()
    loop, thread = _echo_server(target)
    try:
        messages = [bytes([i]) * size for i, size in enumerate((1, 1000, 200_000, 5))]
        with ProxyThread([ProxyRoute(listen, target)], DELAY_S) as proxies:
            results = asyncio.run(_round_trips(listen, messages))
            counts = proxies.proxies[0].counts
            lateness = counts.lateness()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert [echoed for _, echoed in results] == messages
    assert all(rtt >= 2 * DELAY_S for rtt, _ in results), [rtt for rtt, _ in results]
    total = sum(map(len, messages))
    assert sum(counts.up.values()) == sum(counts.down.values()) == total
    assert lateness["chunks"] == len(counts.late_s) >= 2 * len(messages)  # each message, each way, >= 1 chunk
    assert min(counts.late_s) >= 0.0 and lateness["max_us"] >= lateness["mean_us"] >= 0.0
