"""Keeps a server behind NAT reachable while its relays come and go.

It watches the relays the server holds reservations on; when one goes, it picks the survivors and
a replacement that the swarm's records offer, of those the ones that answer now (records outlive
dead relays, and one dead relay in the daemon's list keeps it from reserving on any: see
p2p/relays.py), and has the server start its daemon again on them and announce its new circuit
addresses. The restart ends the server's open streams (libp2p's daemon takes its static relays
only at start): their clients replay their sessions elsewhere or here, as after any server fault.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ...p2p import P2P, RELAY_SLOTS, NetworkError, RelaySlots, live_relays

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
        """Rejoin on the survivors and replacements that answer; while none does, or rejoining fails,
        try again."""
        while True:
            slots = RelaySlots(())
            try:
                slots = await self._choose(lost)
                if slots.relays:
                    await self._rejoin(slots)
                    self.slots = slots
                    return
                logger.warning("No relay left that answers, here or in the swarm's records; this server is "
                               "unreachable until one comes (looking again every %.0f s)", NO_RELAY_RETRY_S)
            except NetworkError as exc:
                logger.warning("Could not rejoin through relays %s: %s", list(slots.relays), exc)
            await asyncio.sleep(NO_RELAY_RETRY_S)

    async def _choose(self, lost: list[str]) -> RelaySlots:
        """The survivors and the relays the records offer, those that answer now, up to RELAY_SLOTS."""
        candidates = self.slots.candidates(lost, await self._find_relays(lost))
        try:
            return RelaySlots(tuple(await live_relays(self._p2p(), candidates, RELAY_SLOTS)))
        except OSError as exc:  # our daemon is gone (a rejoin that failed): nothing to dial them from
            logger.debug("Could not ask the daemon which relays answer (%r); taking them untried", exc)
            return RelaySlots(tuple(candidates[:RELAY_SLOTS]))
