"""A second chance for libp2p's hole punching, for relayed connections it could not upgrade.

libp2p (DCUtR, on in hivemind's daemon) tries once to turn a relayed connection into a direct
one, when the connection opens, and only if both ends serve hole punching; a peer does once four
peers have observed the same public address of it (it checks on a backoff of 0.25 to 5 s). A
client's daemon connects to servers behind NAT through relays within its first second (its DHT
bootstrap), before that: those connections would stay relayed for as long as they live.

So before a client opens a session on a server, `second_chance` looks once per server: if this
peer now has a public address and reaches the server only through relays, it closes those
connections; the session's stream then opens a fresh relayed connection, which libp2p upgrades.
Closing ends the streams open on them (another session of this client on that server replays),
once per server in this daemon's life.
"""

from __future__ import annotations

import ipaddress
import logging
import time
import weakref

from hivemind.p2p import P2P, P2PDaemonError, PeerID

__all__ = ["second_chance"]

logger = logging.getLogger(__name__)

PUBLIC_RECHECK_S = 5.0  # how often a peer without a public address looks again


class _Upgrades:
    def __init__(self):
        self.looked_at: set[str] = set()  # servers already given their chance (or found direct)
        self.public = False
        self.public_checked_at = -PUBLIC_RECHECK_S

    async def has_public_address(self, p2p: P2P) -> bool:
        if not self.public and time.monotonic() - self.public_checked_at >= PUBLIC_RECHECK_S:
            self.public_checked_at = time.monotonic()
            try:
                self.public = any(_is_public(str(maddr)) for maddr in await p2p.get_visible_maddrs(latest=True))
            except (ValueError, P2PDaemonError, OSError):  # no addresses yet, or the daemon is going
                self.public = False
        return self.public


_upgrades: weakref.WeakKeyDictionary[P2P, _Upgrades] = weakref.WeakKeyDictionary()


def _is_public(maddr: str) -> bool:
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    try:
        return ipaddress.ip_address(parts[2]).is_global
    except ValueError:
        return False


async def second_chance(p2p: P2P, peer_id: str) -> None:
    """Close our connections to `peer_id` if all are relayed and we could now be punched through
    (once per peer); the next stream then opens a new one that libp2p tries to make direct."""
    upgrades = _upgrades.setdefault(p2p, _Upgrades())
    if peer_id in upgrades.looked_at or not await upgrades.has_public_address(p2p):
        return
    upgrades.looked_at.add(peer_id)
    try:
        paths = [str(addr) for info in await p2p.list_peers() if info.peer_id.to_base58() == peer_id
                 for addr in info.addrs]
        if paths and all("/p2p-circuit" in path for path in paths):
            logger.debug("Reconnecting to %s so that libp2p can punch through to it", peer_id)
            await p2p._client.disconnect(PeerID.from_base58(peer_id))  # hivemind's P2P has no disconnect
    except (P2PDaemonError, OSError, ValueError) as exc:
        logger.debug("Could not give %s's connection a second chance: %r", peer_id, exc)
