"""TCP proxies that make a peer on this machine look far away: a one-way delay in each direction
and an optional bandwidth cap, for the WAN benchmark (benchmarks/wan.py) and the push-delay test.

Each chunk read is stamped on arrival and written out at arrival + delay (after the chunks
before it, and, with a bandwidth cap, once the link has had time to carry it), so a stream of
chunks is delayed, not slowed: throughput is not serialised by the delay, as on a real long link.
The event loop's timers are coarse (uvloop's count whole milliseconds), so a chunk's timer is set
a little early and the rest of its wait is a blocking sleep: alone on a connection, chunks went
out 0.15 ms after their due time on average; in benchmarks/wan.py's swarm, 0.32 to 0.48 ms over
runs (in like-for-like runs, 0.32 to 0.37 ms, against 0.44 ms on the timer alone). How late each
chunk went out is counted and reported with the byte counts, so that what the floors leave out
is measured, not assumed.
A server announces the proxy's address (`serve --announce-maddrs`), so every peer that dials it
(clients, and other servers pushing to it) goes through the proxy.

Byte counts are kept per accepted connection, keyed by the dialer's port: a libp2p daemon dials
out from its listening port (TCP port reuse), so the port says which peer dialed.

In a thread (tests):        with ProxyThread([ProxyRoute(listen_port, target_port)], delay_s=0.05) as proxies: ...
As a process (benchmarks):  python -m benchmarks.delay_proxy --delay-ms 50 LISTEN:TARGET [LISTEN:TARGET ...]
  (prints "ready", then on SIGTERM, or when its parent dies, one JSON line of byte counts, and exits)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

__all__ = ["DelayProxy", "ProxyRoute", "ProxyThread", "free_port"]

CHUNK_BYTES = 64 << 10
MAX_QUEUED_CHUNKS = 1024  # per direction: at most 64 MiB in flight before reading pauses
TIMER_SLACK_S = 0.002  # a chunk's timer is set this much early; the rest of its wait is time.sleep


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ProxyRoute:
    listen_port: int  # the proxy listens on 127.0.0.1:listen_port
    target_port: int  # and forwards to 127.0.0.1:target_port


@dataclass
class _Link:
    """One direction of a long link: its delay, its capacity, and when it is free to send again."""

    delay_s: float
    bytes_per_s: float | None
    free_at: float = 0.0

    def arrival(self, now: float, size: int) -> float:
        if self.bytes_per_s is None:
            return now + self.delay_s
        self.free_at = max(now, self.free_at) + size / self.bytes_per_s
        return self.free_at + self.delay_s


@dataclass
class Counts:
    """Bytes through one proxy, per dialer port: to the target ("up") and back ("down")."""

    up: collections.Counter = field(default_factory=collections.Counter)
    down: collections.Counter = field(default_factory=collections.Counter)
    connections: collections.Counter = field(default_factory=collections.Counter)
    chunks: int = 0  # delivered, and how late they went out (after their due time): in all, least, most
    late_total_s: float = 0.0
    late_min_s: float = 0.0
    late_max_s: float = 0.0

    def delivered(self, late_s: float) -> None:
        self.late_min_s = late_s if not self.chunks else min(self.late_min_s, late_s)
        self.late_max_s = max(self.late_max_s, late_s)
        self.late_total_s += late_s
        self.chunks += 1

    def lateness(self) -> dict[str, float]:
        """Mean, least and largest delivery lateness in microseconds (0 where nothing was delivered)."""
        return {"mean_us": 1e6 * self.late_total_s / max(self.chunks, 1), "min_us": 1e6 * self.late_min_s,
                "max_us": 1e6 * self.late_max_s, "chunks": self.chunks}


class DelayProxy:
    """One listening port in front of one target, delaying both directions by `delay_s`."""

    def __init__(self, route: ProxyRoute, delay_s: float, bandwidth_bytes_per_s: float | None = None):
        self.route, self.delay_s, self.bandwidth = route, delay_s, bandwidth_bytes_per_s
        self.counts = Counts()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.route.listen_port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dialer_port = writer.get_extra_info("peername")[1]
        self.counts.connections[dialer_port] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.route.target_port)
        except OSError:
            writer.close()
            return
        for source, sink, counter in ((reader, up_writer, self.counts.up), (up_reader, writer, self.counts.down)):
            task = asyncio.create_task(self._carry(source, sink, counter, dialer_port))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _carry(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter,
                     counter: collections.Counter, dialer_port: int) -> None:
        """Read chunks as they come, stamp them (time.monotonic: the loop's clock is coarse), and let
        a writer deliver each at its time."""
        link = _Link(self.delay_s, self.bandwidth)
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_QUEUED_CHUNKS)
        deliver = asyncio.create_task(self._deliver(queue, sink))
        try:
            while not deliver.done() and (chunk := await source.read(CHUNK_BYTES)):
                counter[dialer_port] += len(chunk)
                await queue.put((link.arrival(time.monotonic(), len(chunk)), chunk))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put((link.arrival(time.monotonic(), 0), b""))  # end of stream, delayed like the data
            with contextlib.suppress(ConnectionError, OSError):
                await deliver

    async def _deliver(self, queue: asyncio.Queue, sink: asyncio.StreamWriter) -> None:
        try:
            while True:
                due, chunk = await queue.get()
                await _wait_until(due)
                if not chunk:
                    break
                self.counts.delivered(time.monotonic() - due)
                sink.write(chunk)
                await sink.drain()
        finally:
            sink.close()


async def _wait_until(due: float) -> None:
    """Until time.monotonic() reaches `due`: the loop's timer for most of it, a blocking sleep
    (which holds up this proxy's loop for at most TIMER_SLACK_S) for the last stretch."""
    if (wait_s := due - time.monotonic()) > TIMER_SLACK_S:
        await asyncio.sleep(wait_s - TIMER_SLACK_S)
    if (wait_s := due - time.monotonic()) > 0:
        time.sleep(wait_s)


async def _start_all(routes, delay_s, bandwidth) -> list[DelayProxy]:
    proxies = [DelayProxy(route, delay_s, bandwidth) for route in routes]
    for proxy in proxies:
        await proxy.start()
    return proxies


async def _close_all(proxies: list[DelayProxy]) -> None:
    for proxy in proxies:
        await proxy.close()


class ProxyThread:
    """Proxies on an event loop of their own, in a daemon thread; `proxies[i].counts` can be read
    from the caller's thread (a snapshot may be a few chunks behind)."""

    def __init__(self, routes: list[ProxyRoute], delay_s: float, bandwidth_bytes_per_s: float | None = None):
        self.routes, self.delay_s, self.bandwidth = routes, delay_s, bandwidth_bytes_per_s
        self.proxies: list[DelayProxy] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxies", daemon=True)

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(_start_all(self.routes, self.delay_s, self.bandwidth), self._loop)
        self.proxies = future.result(10)
        return self

    def __exit__(self, *exc_info) -> None:
        future = asyncio.run_coroutine_threadsafe(_close_all(self.proxies), self._loop)
        with contextlib.suppress(Exception):
            future.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _route(text: str) -> ProxyRoute:
    listen, _, target = text.partition(":")
    return ProxyRoute(int(listen), int(target))


async def _serve(args: argparse.Namespace) -> None:
    bandwidth = args.bandwidth_mbit * 125_000 if args.bandwidth_mbit else None
    proxies = await _start_all(args.routes, args.delay_ms / 1000, bandwidth)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(_stop_when_parent_dies(stop))
    print("ready", flush=True)
    await stop.wait()
    watcher.cancel()
    await _close_all(proxies)
    print(json.dumps({str(p.route.listen_port): {"up": dict(p.counts.up), "down": dict(p.counts.down),
                                                 "late": p.counts.lateness()}
                      for p in proxies}), flush=True)


async def _stop_when_parent_dies(stop: asyncio.Event) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    stop.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("routes", nargs="+", type=_route, metavar="LISTEN:TARGET", help="ports on 127.0.0.1")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay, each direction (50)")
    parser.add_argument("--bandwidth-mbit", type=float, default=None, help="cap per direction and connection")
    args = parser.parse_args()
    with contextlib.suppress(PermissionError):  # the links' delays stay what they were set to on a busy
        os.nice(-10)                            # machine (a real network costs this host no CPU); root only
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
