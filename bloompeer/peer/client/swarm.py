"""The client's view of the swarm: which servers serve which blocks, read from the DHT.

Read in the background every refresh period, so that choosing a route costs no DHT lookup
unless the view is stale or has gaps.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ...p2p import BlockDirectory, ServerRecord
from .errors import MissingBlocksError, block_ranges
from .routing import SpanRoute, choose_route, missing_blocks, usable_servers

__all__ = ["SwarmView"]

logger = logging.getLogger(__name__)


class SwarmView:
    def __init__(self, directory: BlockDirectory, model_uid: str, num_blocks: int, fingerprint: str | None,
                 refresh_period_s: float = 10.0):
        self.directory, self.model_uid, self.num_blocks, self.fingerprint = (
            directory, model_uid, num_blocks, fingerprint)
        self.refresh_period_s = refresh_period_s
        self.servers: dict[int, list[ServerRecord]] = {}
        self._updated_at = float("-inf")

    async def refresh(self) -> dict[int, list[ServerRecord]]:
        found = await self.directory.find_servers(self.model_uid, self.num_blocks)
        self.servers, self._updated_at = usable_servers(found, self.fingerprint), time.monotonic()
        return self.servers

    async def keep_fresh(self) -> None:
        """Refresh forever, every period (run as a background task)."""
        while True:
            await asyncio.sleep(self.refresh_period_s)
            try:
                await self.refresh()
            except Exception:
                logger.warning("Could not refresh the view of the swarm", exc_info=True)

    async def route(self, timeout_s: float, poll_period_s: float) -> list[SpanRoute]:
        """A route through all blocks, waiting (with a message) while some block has no server."""
        started = time.monotonic()
        announced_missing = None
        if time.monotonic() - self._updated_at > self.refresh_period_s:
            await self.refresh()
        while True:
            missing = missing_blocks(self.servers, self.num_blocks)
            if not missing:
                route = choose_route(self.servers, self.num_blocks)
                logger.info("Route: %s", " -> ".join(f"{r.peer_id_str[-6:]}[{r.start}:{r.end}]" for r in route))
                return route
            waited_s = time.monotonic() - started
            if waited_s >= timeout_s:
                raise MissingBlocksError(self.model_uid, missing, waited_s)
            if missing != announced_missing:
                logger.warning("No server serves block(s) %s of %s yet; waiting up to %.0f s more",
                               block_ranges(missing), self.model_uid, timeout_s - waited_s)
                announced_missing = missing
            await asyncio.sleep(min(poll_period_s, timeout_s - waited_s))
            await self.refresh()
