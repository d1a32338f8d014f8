"""The client's view of the swarm: which servers serve which blocks, how far away they are, and
which ones it does not trust right now.

Records are read from the DHT in the background every refresh period, and new servers are
pinged, so choosing a route costs no lookup unless the view is stale or has gaps. However many
sessions, requests and threads find it stale at once, they share one refresh in flight.

In the client's code "swarm" always means this view (`SwarmView`); the connection that owns it,
with the network peer and the event loop, is the `SwarmClient` (a model's `client`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from ...p2p import P2P, BlockDirectory, FoundRecord, ServerRecord, get_dht_time
from .errors import MissingBlocksError, RequestTooLargeError, block_ranges
from .health import BanList, ping
from .routing import (
    RequestSize, RoutePlan, ServerFilter, SpanRoute, choose_plan, missing_blocks, refusal_everywhere,
    usable_servers, why_no_route,
)

__all__ = ["SwarmView"]

logger = logging.getLogger(__name__)

RTT_MAX_AGE_S = 60.0  # servers are pinged again after this long


class SwarmView:
    """What one client knows of the swarm of one model, shared by all its sessions and requests.

    One view per client, not per request: the DHT is read in the background rather than on every
    step, and the round trips measured and the bans earned by one request route all the others.
    """

    def __init__(self, p2p: P2P, directory: BlockDirectory, model_uid: str, num_model_blocks: int,
                 allowed: ServerFilter, refresh_period_s: float = 10.0, ping_timeout_s: float = 2.0):
        """allowed: the only servers ever used (routes, replays, checks)."""
        self.p2p, self.directory, self.model_uid, self.num_model_blocks, self.allowed = (
            p2p, directory, model_uid, num_model_blocks, allowed)
        self.refresh_period_s, self.ping_timeout_s = refresh_period_s, ping_timeout_s
        self.announced: dict[int, list[ServerRecord]] = {}  # every record known, usable or not
        self._known: dict[tuple[int, str], FoundRecord] = {}  # (block, peer id) -> its latest record, until it expires
        self.servers: dict[int, list[ServerRecord]] = {}  # those this client may route through
        self.rtts_s: dict[str, float] = {}
        self.bans = BanList()
        self._pinged_at: dict[str, float] = {}
        self._updated_at = float("-inf")
        self._refreshing: asyncio.Future | None = None  # the refresh in flight, shared by all who ask

    async def refresh(self) -> None:
        """Read the DHT again and ping new servers; joins the refresh in flight if there is one (every
        session waiting for blocks, every request of an API server, asks at once). A caller that
        stops waiting (cancelled) does not cancel it for the others."""
        loop = asyncio.get_running_loop()
        if self._refreshing is None or self._refreshing.done() or self._refreshing.get_loop() is not loop:
            self._refreshing = loop.create_task(self._refresh_now(), name="bloompeer-swarm-refresh")
            self._refreshing.add_done_callback(_retrieve_exception)  # all who waited may have left
        await asyncio.shield(self._refreshing)

    async def _refresh_now(self) -> None:
        self._remember(await self.directory.find_records(self.model_uid, self.num_model_blocks))
        self.servers = usable_servers(self.announced, self.allowed)
        self._updated_at = time.monotonic()
        await self._ping_stale()

    def _remember(self, found: dict[int, list[FoundRecord]]) -> None:
        """Add a DHT read to what earlier reads found. A record stays until it expires or a newer one of
        its server replaces it, as on the DHT: a read can come back partial (one block's lookup missing
        peers that another's found), and taking it as the whole truth made routes flap."""
        now, earlier = get_dht_time(), self._known
        known = {}
        for index, items in found.items():
            for item in items:
                key = (index, item.record.peer_id)
                newest = earlier.get(key)
                known[key] = newest if newest and newest.expiration_time > item.expiration_time else item
        known |= {key: item for key, item in earlier.items() if key not in known and item.expiration_time > now}
        self._known = known
        self.announced = {}
        for (index, _), item in known.items():
            self.announced.setdefault(index, []).append(item.record)

    async def unserved_blocks(self) -> list[int]:
        """Blocks that no server this client may use serves now, as its last read of the DHT and its bans
        say: what a request would wait for. No lookup; a coroutine so that it reads on the client's loop."""
        return missing_blocks(self.servers, 0, self.num_model_blocks, self.bans.banned())

    async def _ping_stale(self) -> None:
        """Ping servers not pinged lately, and again every time those that did not answer."""
        now = time.monotonic()
        peers = {record.peer_id for records in self.servers.values() for record in records}
        stale = [peer for peer in peers if now - self._pinged_at.get(peer, float("-inf")) > RTT_MAX_AGE_S
                 or self.rtts_s.get(peer) == float("inf")]
        rtts = await asyncio.gather(*(ping(self.p2p, peer, self.ping_timeout_s) for peer in stale))
        for peer, rtt_s in zip(stale, rtts):
            self.rtts_s[peer], self._pinged_at[peer] = rtt_s, now

    async def keep_fresh(self) -> None:
        """Refresh forever, every period (run as a background task)."""
        while True:
            await asyncio.sleep(self.refresh_period_s)
            try:
                await self.refresh()
            except Exception:
                logger.warning("Could not refresh the view of the swarm", exc_info=True)

    async def route(self, start: int = 0, end: int | None = None, min_cache_tokens: int = 0,
                    timeout_s: float = 60.0, poll_period_s: float = 1.0, request: RequestSize = RequestSize(),
                    refusals: Mapping[str, str] = {}) -> list[SpanRoute]:
        """The fastest route through blocks [start, end) for `request`, a round trip per server;
        see plan()."""
        return (await self.plan(start, end, min_cache_tokens, timeout_s, poll_period_s, request, refusals)).route

    async def plan(self, start: int = 0, end: int | None = None, min_cache_tokens: int = 0,
                   timeout_s: float = 60.0, poll_period_s: float = 1.0, request: RequestSize = RequestSize(),
                   refusals: Mapping[str, str] = {}, push: bool | None = False) -> RoutePlan:
        """The fastest route through blocks [start, end) for `request`, without push, with push, or
        (push None) whichever is faster by enough; waiting (with a message) while some block has no
        usable server, up to `timeout_s`; at once RequestTooLargeError if the request is over the
        limits of every server of some block, as their records announce them or as they answered.
        `refusals`: peers not to use for this request only (they refused it), with why."""
        end = self.num_model_blocks if end is None else end
        started = time.monotonic()
        announced_missing = None
        if time.monotonic() - self._updated_at > self.refresh_period_s:
            await self.refresh()
        while True:
            refusal = refusal_everywhere(self.servers, start, end, request) or self._refused_everywhere(
                start, end, refusals)
            if refusal is not None:
                raise RequestTooLargeError(self.model_uid, refusal)
            banned = self.bans.banned() | set(refusals)
            plan = choose_plan(self.servers, start, end, self.rtts_s, banned, min_cache_tokens, request, push)
            if plan is not None:
                logger.info("Route for blocks %d:%d%s: %s (about %.0f ms a step)", start, end,
                            ", pushed" if plan.push else "",
                            " -> ".join(f"{r.peer_id_str[-8:]}[{r.start}:{r.end}]" for r in plan.route),
                            1000 * plan.cost_s)
                return plan
            # no gap but no route: every block has a server, but not enough of them have cache room
            missing = missing_blocks(self.servers, start, end, banned) or list(range(start, end))
            waited_s = time.monotonic() - started
            if waited_s >= timeout_s:
                seen = why_no_route(self.announced, start, end, self.allowed, banned, min_cache_tokens)
                raise MissingBlocksError(self.model_uid, missing, waited_s, seen=seen)
            if missing != announced_missing:
                logger.warning("No usable server for block(s) %s of %s yet; waiting up to %.0f s more",
                               block_ranges(missing), self.model_uid, timeout_s - waited_s)
                announced_missing = missing
            await asyncio.sleep(min(poll_period_s, timeout_s - waited_s))
            await self.refresh()

    def _refused_everywhere(self, start: int, end: int, refusals: Mapping[str, str]) -> str | None:
        """Why every server of some block in [start, end) refused this request (None if one has not)."""
        if not refusals:
            return None
        blocks = missing_blocks(self.servers, start, end, set(refusals))
        blocks = [index for index in blocks if self.servers.get(index)]
        if not blocks:
            return None
        refuser = next(record.peer_id for record in self.servers[blocks[0]] if record.peer_id in refusals)
        return f"every server of block {blocks[0]} refused it; {refusals[refuser]}"


def _retrieve_exception(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
