"""Relays for a server behind NAT: found in the swarm's records, held, watched.

Directly reachable servers that relay say so in their records (`relay_maddrs`). A server that
cannot be dialed reserves a slot on RELAY_SLOTS of them (its daemon's static relays: it reserves
on each and is announced at each one's circuit address), so that losing one leaves it reachable.
RelaySlots.wait_for_loss watches the daemon's connections to them: a relay that goes (its process
or machine dies, it leaves the swarm) drops its connection at once, and the server then starts
its daemon again on the survivors and a replacement from the records.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P

from .errors import ProtocolError
from .maddrs import check_circuit_maddr, check_peer_maddr, peer_id_in
from .records import MAX_RELAY_MADDRS, ServerRecord, ServerState

__all__ = ["RELAY_SLOTS", "RelaySlots", "announceable", "relays_in_records"]

logger = logging.getLogger(__name__)

RELAY_SLOTS = 2  # relays a server behind NAT holds a reservation on
WATCH_PERIOD_S = 0.5
CONNECT_GRACE_S = 10.0  # a relay never connected in this long after the daemon started counts as gone


def relays_in_records(records: Iterable[ServerRecord], exclude: Iterable[str] = ()) -> list[str]:
    """One relay multiaddr per online, directly reachable server that offers to relay, in random
    order (so that servers behind NAT spread over the relays); none of the peers in `exclude`."""
    excluded, offers = set(exclude), {}
    for record in records:
        if record.relay_maddrs and not record.relayed and record.state is ServerState.ONLINE:
            if record.peer_id not in excluded:
                offers.setdefault(record.peer_id, record.relay_maddrs[0])
    relays = list(offers.values())
    random.shuffle(relays)
    return relays


def announceable(maddrs: Iterable[str], check=check_peer_maddr) -> tuple[str, ...]:
    """The first MAX_RELAY_MADDRS of `maddrs` that records may carry (peers refuse a record with
    any other, so one odd address, say an initial peer's, must not make the whole record void)."""
    kept = []
    for maddr in maddrs:
        try:
            kept.append(check(maddr))
        except ProtocolError:
            logger.debug("Not announcing %r: records cannot carry it", maddr)
    return tuple(kept[:MAX_RELAY_MADDRS])


@dataclass(frozen=True)
class RelaySlots:
    """The relays (multiaddrs ending /p2p/<relay id>) one daemon holds reservations on."""

    relays: tuple[str, ...]

    @property
    def circuit_maddrs(self) -> tuple[str, ...]:
        return tuple(f"{relay}/p2p-circuit" for relay in self.relays)

    def announced(self) -> tuple[str, ...]:
        """The circuit addresses our records carry (`via_relays`)."""
        return announceable(self.circuit_maddrs, check_circuit_maddr)

    @classmethod
    def of(cls, maddrs: Iterable[str]) -> RelaySlots:
        """Relays from multiaddrs that name their peer (/p2p/<id>); others cannot be reserved on."""
        return cls(tuple(maddr for maddr in maddrs if "/p2p/" in maddr))

    def peer_ids(self) -> list[str]:
        return [peer_id_in(relay) for relay in self.relays]

    def replaced(self, lost: Iterable[str], candidates: Sequence[str]) -> RelaySlots:
        """The relays left after `lost` (relay peer ids) went, topped up from `candidates` to RELAY_SLOTS."""
        gone = set(lost)
        kept = [relay for relay in self.relays if peer_id_in(relay) not in gone]
        held = {peer_id_in(relay) for relay in kept}
        for candidate in candidates:
            if len(kept) >= RELAY_SLOTS:
                break
            if peer_id_in(candidate) not in held | gone:
                kept.append(candidate)
                held.add(peer_id_in(candidate))
        return RelaySlots(tuple(kept))

    async def wait_for_loss(self, p2p: P2P, period_s: float = WATCH_PERIOD_S) -> list[str]:
        """Return (peer ids) once any of these relays is no longer connected to `p2p`, or was never
        connected within CONNECT_GRACE_S; a failing look at the daemon counts as no change."""
        watched, seen = set(self.peer_ids()), set()
        deadline = asyncio.get_running_loop().time() + CONNECT_GRACE_S
        while True:
            try:
                connected = {info.peer_id.to_base58() for info in await p2p.list_peers()
                             if any("p2p-circuit" not in str(addr) for addr in info.addrs)}
            except Exception as exc:  # the daemon's control socket: lost relays show next time
                logger.debug("Could not list the daemon's connections: %r", exc)
                connected = watched
            seen |= watched & connected
            lost = sorted((seen - connected) | (watched - seen if asyncio.get_running_loop().time() > deadline
                                                else set()))
            if lost:
                return lost
            await asyncio.sleep(period_s)
