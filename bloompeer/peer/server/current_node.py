"""The server's peer node now: what every part of a server that talks to the network reads it through.

Behind NAT, a server whose relay went starts its daemon again on other relays (relay_keeper.py):
a new PeerNode, with the same peer id. A part that kept the old node, or its P2P, would speak
through a dead daemon, so none keeps one: the push sender, the round-trip meter, the rebalancer
and the announcer read the node here at each use, and a rejoin replaces it in this one place,
which also serves the same handlers on the new daemon.
"""

from __future__ import annotations

from ...p2p import P2P, BlockDirectory, NetworkConfig, PeerNode, RelaySlots, StreamHandler, serve, stop_serving

__all__ = ["CurrentNode"]


class CurrentNode:
    def __init__(self, node: PeerNode, relays: RelaySlots | None = None, relay_maddrs: tuple[str, ...] = ()):
        self.node = node
        self.relays = relays  # behind NAT: reached through these relays (None: directly, or not known)
        self.relay_maddrs = relay_maddrs  # where peers behind NAT reserve on us (we relay, and are reachable)
        self._handlers: dict[str, StreamHandler] = {}  # protocol -> handler, served again after a rejoin

    @property
    def p2p(self) -> P2P:
        return self.node.p2p

    @property
    def directory(self) -> BlockDirectory:
        return self.node.directory

    @property
    def peer_id_str(self) -> str:
        return self.node.peer_id_str

    async def serve(self, protocol: str, handler: StreamHandler) -> None:
        """Answer streams for `protocol` with `handler`, on this daemon and on any later one."""
        await serve(self.p2p, protocol, handler)
        self._handlers[protocol] = handler

    async def stop_serving(self) -> None:
        """Answer no more streams (at shutdown: the last words to the network)."""
        for protocol in self._handlers:
            await stop_serving(self.p2p, protocol)

    async def rejoin(self, network: NetworkConfig, relays: RelaySlots) -> None:
        """This peer on a new daemon started with `network`, reached through `relays`, serving the same
        handlers; the streams open now end. NetworkError if it cannot (the old daemon is stopped
        either way)."""
        self.node = await self.node.rejoin(network)
        self.relays = relays
        for protocol, handler in self._handlers.items():
            await serve(self.p2p, protocol, handler)
