"""`bloompeer serve`: serve a range of a model's blocks until interrupted, then drain and leave."""

from __future__ import annotations

import argparse
import asyncio
import functools
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
        print(_online_line(server), flush=True)
        server.on_move = functools.partial(_print_move, server)
        server.on_relays = functools.partial(print, flush=True)  # "relays: ... left; reserved on ..."
        stopping, failing = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.failed.wait())
        await asyncio.wait([stopping, failing], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        failing.cancel()
        if server.failed.is_set():
            return 1  # the server logged why
        stop.clear()
        logger.info("Draining (up to %.0f s; signal again to exit now)", config.drain_timeout_s)
        draining = asyncio.ensure_future(server.drain(config.drain_timeout_s))
        await asyncio.wait([draining, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        draining.cancel()
    finally:
        await server.shutdown()
    return 0


def _online_line(server) -> str:
    return f"online: serving {server.model_uid} blocks {server.start}:{server.end} as {server.node.peer_id_str}"


def _print_move(server, stage: str, plan) -> None:
    """A --num-blocks server moving where the swarm needs it: "moving: ..." when it commits, then its
    "online: ..." line again once it serves the new blocks."""
    if stage == "moving":
        print(f"moving: to {server.model_uid} blocks {plan.start}:{plan.end} ({plan.reason})", flush=True)
    else:
        print(_online_line(server), flush=True)
