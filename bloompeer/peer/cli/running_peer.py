"""What the long-running peer commands (dht, serve) share: their event loop, signals, and the
addresses they print."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
from collections.abc import Awaitable

__all__ = ["reachable_first", "run_until_done", "signal_event"]

logger = logging.getLogger("bloompeer")

EXIT_DEADLINE_S = 10.0  # from the command's end to the process's: the loop's cleanup and interpreter exit


def signal_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (each time one arrives: clear it to wait for the next)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event


async def reachable_first(node) -> list[str]:
    """The peer's multiaddrs, loopback ones last (they are of use only on this machine)."""
    return sorted(await node.visible_maddrs(), key=lambda maddr: "/127." in maddr or "/ip6/::1/" in maddr)


def run_until_done(command: Awaitable[int]) -> int:
    """Run a peer command on uvloop (errors go up to cli.main, which reports them)."""
    import uvloop

    return uvloop.run(_with_a_bounded_exit(_quiet_about_lost_daemon(command)))


async def _with_a_bounded_exit(command: Awaitable[int]) -> int:
    """Run `command`; once it ends (daemon reaped, files closed), what is left (cancelling stray
    tasks, joining executor threads, interpreter exit) must not keep a stopped peer alive: past
    EXIT_DEADLINE_S every thread's stack goes to stderr and the process exits with code 1."""
    try:
        return await command
    finally:
        faulthandler.dump_traceback_later(EXIT_DEADLINE_S, exit=True)


async def _quiet_about_lost_daemon(command: Awaitable[int]) -> int:
    """Run `command`; at exit, hivemind's tasks talking to a daemon that is already gone (killed with
    our process group) fail with connection errors: expected then, so logged at debug level."""
    loop = asyncio.get_running_loop()

    def handle(loop, context) -> None:
        exc = context.get("exception")
        if isinstance(exc, ConnectionError) or (isinstance(exc, RuntimeError) and "closed" in str(exc)):
            logger.debug("Ignored at exit: %s", context.get("message"))
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
    return await command
