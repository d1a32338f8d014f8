"""`bloompeer serve`: serve a range of a model's blocks until interrupted, then drain and leave."""

from __future__ import annotations

import argparse
import asyncio
import logging

from .flags import add_server_flags, server_config
from .import_gc import imports_without_gc
from .running_peer import reachable_first, run_until_done, signal_event

__all__ = ["add_parser", "run"]

logger = logging.getLogger("bloompeer")


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve a range of a model's blocks to the swarm",
                                description="Load blocks A..B-1 of a model (BLOOM or the Llama family) and serve them to "
                                            "the swarm until interrupted (SIGINT or SIGTERM), then announce offline and "
                                            "exit.")
    add_server_flags(serve)


def run(args: argparse.Namespace) -> int:
    return run_until_done(_run(args))


async def _run(args: argparse.Namespace) -> int:
    with imports_without_gc():
        from ..server.server import Server

    config = server_config(args)
    stop = signal_event()
    starting = asyncio.ensure_future(Server.create(config))
    await asyncio.wait([starting, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # interrupted while loading: Server.create cleans up after itself
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return 0
    server = starting.result()
    try:
        for maddr in await reachable_first(server.node):
            print(maddr, flush=True)
        print(server.reachability, flush=True)
        if server.metrics_endpoint is not None:
            print(f"metrics: {server.metrics_endpoint.url}", flush=True)
        print(f"online: serving {server.model_uid} blocks {server.start}:{server.end} as {server.node.peer_id_str}",
              flush=True)
        await stop.wait()
        stop.clear()
        logger.info("Draining (up to %.0f s; signal again to exit now)", config.drain_timeout_s)
        draining = asyncio.ensure_future(server.drain(config.drain_timeout_s))
        await asyncio.wait([draining, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        draining.cancel()
    finally:
        await server.shutdown()
    return 0
