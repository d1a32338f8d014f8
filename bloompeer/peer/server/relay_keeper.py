"""Keeps a server behind NAT reachable while its relays come and go.

It watches the relays the server holds reservations on; when one goes, it picks the survivors and
a replacement that the swarm's records offer, and has the server start its daemon again on them
and announce its new circuit addresses. The restart ends the server's open streams (libp2p's
daemon takes its static relays only at start): their clients replay their sessions elsewhere or
here, as after any server fault.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ...p2p import P2P, NetworkError, RelaySlots

__all__ = ["RelayKeeper"]

logger = logging.getLogger(__name__)

NO_RELAY_RETRY_S = 5.0  # when no relay is left and the records offer none: look again this often


class RelayKeeper:
    def __init__(self, slots: RelaySlots, p2p: Callable[[], P2P],
                 find_relays: Callable[[list[str]], Awaitable[list[str]]],
                 rejoin: Callable[[RelaySlots], Awaitable[None]], report: Callable[[str], None]):
        """p2p: the server's daemon now; find_relays(lost): relay multiaddrs the records offer, none of
        the lost peers; rejoin: restart the daemon on these relays and announce; report: say what changed."""
        self.slots, self._p2p, self._find_relays, self._rejoin, self._report = slots, p2p, find_relays, rejoin, report

    async def run(self) -> None:
        while True:
            lost = await self.slots.wait_for_loss(self._p2p())
            started = time.monotonic()
            await self._replace(lost)
            self._report(f"relays: {', '.join(peer[-8:] for peer in lost)} left; reserved on "
                         f"{', '.join(self.slots.relays)} and announced again in {time.monotonic() - started:.2f} s")

    async def _replace(self, lost: list[str]) -> None:
        """Rejoin on the survivors and replacements; while there are none, or rejoining fails, try again."""
        while True:
            try:
                slots = self.slots.replaced(lost, await self._find_relays(lost))
                if slots.relays:
                    await self._rejoin(slots)
                    self.slots = slots
                    return
                logger.warning("No relay left and the swarm offers none; this server is unreachable until one "
                               "comes (looking again every %.0f s)", NO_RELAY_RETRY_S)
            except NetworkError as exc:
                logger.warning("Could not rejoin through relays %s: %s", list(slots.relays), exc)
            await asyncio.sleep(NO_RELAY_RETRY_S)
