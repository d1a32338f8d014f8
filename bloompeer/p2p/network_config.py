"""How a peer joins the network, in one frozen value (built from the command line's flags).

Its own module, free of hivemind, so that configs and flags can be built without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NetworkConfig"]


@dataclass(frozen=True)
class NetworkConfig:
    initial_peers: tuple[str, ...] = ()  # multiaddrs of peers already in the swarm (none: start a new swarm)
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)  # where to listen
    announce_maddrs: tuple[str, ...] = ()  # addresses to tell others instead of the listening ones
    identity_path: str | None = None  # private key file; keeps the peer id across restarts
    client_mode: bool = False  # dial out only; answer no DHT queries
    relay_for_others: bool = False  # serve as a circuit relay for peers behind NAT (bootstrap peers and servers do)
    relays: tuple[str, ...] = ()  # we are behind NAT: be reached through these relays (multiaddrs)
    dht_timeout_s: float = 10.0
