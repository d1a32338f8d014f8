"""How far this server is from the servers it could push to, announced in its record so that
clients can route pushed chains (client -> A -> B -> ... -> client) through nearby servers.

A server serving blocks [start, end) can pass a step on, at any boundary b in (start, end], to a
server holding block b: those are its possible next hops. It pings the nearest of them (by
blocks) now and then, and its record carries the round trips (at most MAX_PUSH_RTTS of them).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ...p2p import MAX_PUSH_RTTS, MAX_RTT_S, ServerRecord, ServerState, ping
from .current_node import CurrentNode

__all__ = ["PushRtts", "next_hops"]

logger = logging.getLogger(__name__)

RTT_MAX_AGE_S = 60.0  # a next hop is pinged again after this long
PING_TIMEOUT_S = 2.0


def next_hops(servers: dict[int, list[ServerRecord]], start: int, end: int, own_peer_id: str) -> list[str]:
    """Online servers that could follow blocks [start, end) of ours in a chain (they hold a block b
    with start < b <= end), nearest first: those starting at our end, then by distance in blocks."""
    starts: dict[str, int] = {}
    for index in range(start + 1, end + 1):
        for record in servers.get(index, ()):
            if record.peer_id != own_peer_id and record.state is ServerState.ONLINE:
                starts[record.peer_id] = record.start
    return sorted(starts, key=lambda peer: (abs(starts[peer] - end), peer))[:MAX_PUSH_RTTS]


class PushRtts:
    """Round trips to this server's possible next hops, as it last measured them."""

    def __init__(self, node: CurrentNode):
        self.node = node
        self._measured: dict[str, tuple[float, float]] = {}  # peer id -> (seconds, when measured)

    def announced(self) -> tuple[tuple[str, float], ...]:
        return tuple(sorted((peer, rtt_s) for peer, (rtt_s, _) in self._measured.items()))

    async def refresh(self, servers: dict[int, list[ServerRecord]], start: int, end: int) -> bool:
        """Ping next hops not measured lately, forget servers that are no longer next hops; True if
        the set of servers with a round trip changed (worth announcing now)."""
        hops = next_hops(servers, start, end, self.node.peer_id_str)
        before = set(self._measured)
        self._measured = {peer: self._measured[peer] for peer in hops if peer in self._measured}
        now = time.monotonic()
        stale = [peer for peer in hops if peer not in self._measured or now - self._measured[peer][1] > RTT_MAX_AGE_S]
        rtts = await asyncio.gather(*(ping(self.node.p2p, peer, PING_TIMEOUT_S) for peer in stale))
        for peer, rtt_s in zip(stale, rtts):
            self._measured[peer] = (min(rtt_s, MAX_RTT_S), now)  # unreachable: announced as very far
            logger.debug("Round trip to next hop %s: %.1f ms", peer, 1000 * rtt_s)
        return set(self._measured) != before
