"""How far away a server is: the round trip of opening a stream to it and reading its info frame.

Used by clients (routing: which servers are near) and by servers (routing of pushed chains:
how near the servers they would push to are, announced in their records).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time

from .errors import RemoteError
from .messages import INFO_PROTOCOL, ServerInfo
from .streams import P2P, request_once

__all__ = ["PINGS", "ping"]

logger = logging.getLogger(__name__)

PINGS = 3  # per measurement, averaged: a server that stalls now and then is slow, however fast its best ping
PING_INTERVAL_S = 0.05  # spaced out, so that the pings sample different moments of the server's life


async def ping(p2p: P2P, peer_id_str: str, timeout_s: float) -> float:
    """Mean seconds of a few round trips to the server (a stream and its info frame); inf if it
    does not answer. The first round trip, which may have to set up the connection (several
    round trips of handshakes, paid once, not per request), is not counted."""
    if await _ping_once(p2p, peer_id_str, timeout_s) == float("inf"):
        return float("inf")
    rtts = []
    for attempt in range(PINGS):
        if attempt:
            await asyncio.sleep(PING_INTERVAL_S)
        rtts.append(await _ping_once(p2p, peer_id_str, timeout_s))
        if rtts[-1] == float("inf"):
            break
    return statistics.fmean(rtts)


async def _ping_once(p2p: P2P, peer_id_str: str, timeout_s: float) -> float:
    started = time.perf_counter()
    try:
        await request_once(p2p, peer_id_str, INFO_PROTOCOL, None, ServerInfo, timeout_s, "ping")
    except RemoteError as exc:
        logger.debug("Ping of %s failed: %s", peer_id_str, exc)
        return float("inf")
    return time.perf_counter() - started
