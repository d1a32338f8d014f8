"""How a server joins the network: directly if a peer of the swarm can dial it back, otherwise
through relays (a server behind NAT without a forwarded port).

The server starts as a relay for others (unless --no-relay) and stays one if it is directly
reachable: any peer that names it in --initial-peers can then be reached through it. Its initial
peers are also its relays if it turns out to be unreachable and the swarm's records offer none.

A server that cannot be dialed does not host DHT keys for others (it joins the DHT as a client)
and announces its relay (circuit) addresses; its records say `relayed`, so routing prefers
direct servers. The one line it prints says which of the two it is, and what to do about it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ...p2p import RELAY_SLOTS, NetworkConfig, PeerNode, RelaySlots, live_relays, reachable_maddrs

__all__ = ["Joined", "behind_relays", "join_network"]

logger = logging.getLogger(__name__)

FindRelays = Callable[[PeerNode], Awaitable[list[str]]]  # relay multiaddrs the swarm's records offer


@dataclass
class Joined:
    node: PeerNode
    line: str  # the reachability line to print
    relays: RelaySlots | None = None  # reached through these (None: directly, or not known)
    reachable: tuple[str, ...] = ()  # our addresses a peer could dial (with /p2p/<id>): where we relay


def _without_peer_id(maddr: str) -> str:
    return maddr.rsplit("/p2p/", 1)[0]


def behind_relays(network: NetworkConfig, slots: RelaySlots) -> NetworkConfig:
    """A server behind NAT: reached through `slots`, hosting no DHT keys (nobody could dial it)."""
    return dataclasses.replace(network, relays=slots.relays, client_mode=True, relay_for_others=False)


async def join_network(network: NetworkConfig, find_relays: FindRelays) -> Joined:
    """Join directly if a peer can dial us back, else through relays: RELAY_SLOTS of those the
    swarm's records offer that answer now (a record outlives its relay by up to three announce
    periods, and one dead relay would keep the daemon from reserving on any: p2p/relays.py), or
    if none does, our initial peers."""
    node = await PeerNode.create(network, announcing=True)
    if not network.initial_peers:
        return Joined(node, "reachability: not checked (no other peer to ask; this is the first peer)")
    own = [_without_peer_id(m) for m in await node.visible_maddrs() if "p2p-circuit" not in m]
    helpers = [m.rsplit("/p2p/", 1)[1] for m in network.initial_peers if "/p2p/" in m]
    try:
        reachable, helper = await reachable_maddrs(node.p2p, helpers, own)
        offered = await find_relays(node) if not reachable and helper is not None else []
        offered = await live_relays(node.p2p, offered, RELAY_SLOTS) if offered else []
    except BaseException:
        await node.shutdown()
        raise
    if reachable:
        return Joined(node, f"reachability: directly reachable at {', '.join(reachable)}",
                      reachable=tuple(f"{m}/p2p/{node.peer_id_str}" for m in reachable))
    if helper is None:
        return Joined(node, "reachability: unknown (no peer answered the check); serving on the addresses above")
    slots = RelaySlots.of(offered or network.initial_peers)
    logger.info("%s could not dial any of %s; restarting behind relays %s", helper, own, list(slots.relays))
    node = await node.rejoin(behind_relays(network, slots))
    source = "found on the DHT" if offered else "(the initial peers)"
    line = (f"reachability: NOT directly reachable (peer {helper[-8:]} could not connect to {', '.join(own)}); "
            f"serving through relays {source} {', '.join(slots.relays)}. Clients still reach this server, a "
            f"little slower. To be reached directly, forward a TCP port on your router to this machine and restart "
            f"with --host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/YOUR_PUBLIC_IP/tcp/PORT")
    return Joined(node, line, relays=slots)
