"""Relays for a server behind NAT: found in the swarm's records, held, watched.

Directly reachable servers that relay say so in their records (`relay_maddrs`). A server that
cannot be dialed reserves a slot on RELAY_SLOTS of them (its daemon's static relays: it reserves
on each and is announced at each one's circuit address), so that losing one leaves it reachable.
RelaySlots.wait_for_loss watches the daemon's connections to them: a relay that goes (its process
or machine dies, it leaves the swarm) drops its connection at once, and the server then starts
its daemon again on the survivors and a replacement from the records.

Only relays that answer now are reserved on (live_relays): records outlive a dead relay by up to
three announce periods, and libp2p's autorelay, given static relays, waits until it could connect
to all of them before it reserves on any (go-libp2p autorelay: WithStaticRelays sets
minCandidates to their number; below it, no reservation until its 3-minute boot delay). One dead
relay among two left the server reachable through neither: clients got NO_RESERVATION from the
live one.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils.multiaddr import Multiaddr

from .errors import ProtocolError
from .maddrs import check_circuit_maddr, check_peer_maddr, peer_id_in
from .records import MAX_RELAY_MADDRS, ServerRecord, ServerState

__all__ = ["RELAY_SLOTS", "RelaySlots", "announceable", "live_relays", "relays_in_records"]

logger = logging.getLogger(__name__)

RELAY_SLOTS = 2  # relays a server behind NAT holds a reservation on
WATCH_PERIOD_S = 0.5
# a relay never connected in this long after the daemon started counts as gone (and with it, every
# reservation: autorelay reserves on none while one static relay is missing, see above)
CONNECT_GRACE_S = 10.0
# a relay that does not take a connection in this long counts as dead: in tests/nat/test_relays.py
# (veth links, 2 loaded cores) a live one answered in 0.6 to 6.6 ms and a dead one's port refused
# in 2 ms; on the internet a dial is a few round trips, and a dead host may not answer at all
PROBE_TIMEOUT_S = 3.0
PROBES_AT_ONCE = 4  # candidates dialed in parallel (a swarm's records may offer many relays)


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

    def candidates(self, lost: Iterable[str], offered: Sequence[str]) -> list[str]:
        """The relays to hold after `lost` (relay peer ids) went, in order of preference: the
        survivors, then `offered`; one address per relay, none of the lost."""
        gone, held, ordered = set(lost), set(), []
        for relay in (*self.relays, *offered):
            if peer_id_in(relay) not in gone | held:
                ordered.append(relay)
                held.add(peer_id_in(relay))
        return ordered

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


async def live_relays(p2p: P2P, relays: Sequence[str], wanted: int = RELAY_SLOTS,
                      timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """The first `wanted` of `relays` (multiaddrs ending /p2p/<id>), in their order, that `p2p`
    could connect to now; dialed PROBES_AT_ONCE at a time. A relay we are connected to already
    answers at once. OSError: our own daemon could not be asked (it is gone)."""
    live: list[str] = []
    for start in range(0, len(relays), PROBES_AT_ONCE):
        if len(live) >= wanted:
            break
        batch = relays[start:start + PROBES_AT_ONCE]
        answers = await asyncio.gather(*(_connects(p2p, relay, timeout_s) for relay in batch))
        live.extend(relay for relay, answered in zip(batch, answers) if answered)
    return live[:wanted]


async def _connects(p2p: P2P, relay: str, timeout_s: float) -> bool:
    """Whether the daemon connects to `relay` within `timeout_s` (hivemind's P2P has no connect of its
    own); OSError, from the daemon's control socket, is ours, and raised."""
    address, _, peer_id_str = relay.rpartition("/p2p/")
    started = time.perf_counter()
    try:
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id_str), [Multiaddr(address)]), timeout_s)
    except (P2PDaemonError, ValueError, asyncio.TimeoutError) as exc:
        logger.debug("Relay %s does not answer (%r); not reserving on it", relay, exc)
        return False
    logger.debug("Relay %s answered in %.1f ms", relay, 1000 * (time.perf_counter() - started))
    return True
