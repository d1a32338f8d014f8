"""Server-to-server push: a server sends its output for a step straight to the next server of the
client's chain, so one step costs one pass along the chain instead of a round trip per server.

Streams to next hops are kept open and shared by all sessions going that way. A push that cannot
be delivered is dropped with a warning: the client, missing that hop's answer, recovers as from
any failed server.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from ...p2p import P2P, PUSH_PROTOCOL, PeerStream, PushStep, PushTarget, RemoteError

__all__ = ["PushSender"]

logger = logging.getLogger(__name__)


class PushSender:
    def __init__(self, p2p: P2P, own_peer_id: str, timeout_s: float = 10.0):
        self.p2p, self.own_peer_id, self.timeout_s = p2p, own_peer_id, timeout_s  # a hop here is no push: handlers.py
        self._streams: dict[str, PeerStream] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._pushing: Counter[str] = Counter()  # pushes under way (or waiting) per next hop

    async def push(self, target: PushTarget, step: PushStep) -> None:
        peer = target.peer_id_str
        lock = self._locks.setdefault(peer, asyncio.Lock())
        self._pushing[peer] += 1
        try:
            async with lock:  # one frame at a time per stream; a fresh stream if the kept one broke
                await self._send(peer, step)
        finally:
            self._pushing[peer] -= 1
            if not self._pushing[peer]:  # forget a hop nobody pushes to and no stream is kept for: a
                del self._pushing[peer]  # client may name any peer id as its next hop
                if peer not in self._streams:
                    del self._locks[peer]

    async def _send(self, peer: str, step: PushStep) -> None:
        for attempt in range(2):
            try:
                stream = await self._stream(peer)
                await stream.send(step, self.timeout_s)
                return
            except RemoteError as exc:
                self._drop(peer)
                if attempt:
                    logger.warning("Could not push a step to %s: %r", peer, exc)

    async def _stream(self, peer_id_str: str) -> PeerStream:
        if peer_id_str not in self._streams:
            self._streams[peer_id_str] = await PeerStream.open(self.p2p, peer_id_str, PUSH_PROTOCOL, self.timeout_s,
                                                               "push")
        return self._streams[peer_id_str]

    def _drop(self, peer_id_str: str) -> None:
        stream = self._streams.pop(peer_id_str, None)
        if stream is not None:
            stream.writer.close()

    def close(self) -> None:
        for peer_id_str in list(self._streams):
            self._drop(peer_id_str)
