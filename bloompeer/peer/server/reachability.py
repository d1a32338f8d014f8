"""How a server joins the network: directly if a peer of the swarm can dial it back, otherwise
through relays (a server behind NAT without a forwarded port).

The server starts as a relay for others (unless --no-relay) and stays one if it is directly
reachable: any peer that names it in --initial-peers can then be reached through it. Its initial
peers are also its relays if it turns out to be unreachable.

A server that cannot be dialed does not host DHT keys for others (it joins the DHT as a client)
and announces its relay (circuit) addresses; its records say `relayed`, so routing prefers
direct servers. The one line it prints says which of the two it is, and what to do about it.
"""

from __future__ import annotations

import dataclasses
import logging

from ...p2p import NetworkConfig, PeerNode, reachable_maddrs

__all__ = ["join_network"]

logger = logging.getLogger(__name__)


def _without_peer_id(maddr: str) -> str:
    return maddr.rsplit("/p2p/", 1)[0]


async def join_network(network: NetworkConfig) -> tuple[PeerNode, str, bool]:
    """(the node, the reachability line to print, whether it is reached through relays)."""
    node = await PeerNode.create(network, announcing=True)
    if not network.initial_peers:
        return node, "reachability: not checked (no other peer to ask; this is the first peer)", False
    own = [_without_peer_id(m) for m in await node.visible_maddrs() if "p2p-circuit" not in m]
    helpers = [m.rsplit("/p2p/", 1)[1] for m in network.initial_peers if "/p2p/" in m]
    try:
        reachable, helper = await reachable_maddrs(node.p2p, helpers, own)
    except BaseException:
        await node.shutdown()
        raise
    if reachable:
        return node, f"reachability: directly reachable at {', '.join(reachable)}", False
    if helper is None:
        return node, "reachability: unknown (no peer answered the check); serving on the addresses above", False
    logger.info("%s could not dial any of %s; restarting behind relays", helper, own)
    await node.shutdown()
    relays = tuple(network.initial_peers)
    behind_nat = dataclasses.replace(network, relays=relays, client_mode=True, relay_for_others=False)
    node = await PeerNode.create(behind_nat, announcing=True)
    line = (f"reachability: NOT directly reachable (peer {helper[-8:]} could not connect to {', '.join(own)}); "
            f"serving through relay {relays[0]}. Clients still reach this server, a little slower. To be reached "
            f"directly, forward a TCP port on your router to this machine and restart with "
            f"--host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/YOUR_PUBLIC_IP/tcp/PORT")
    return node, line, True
