"""Server-to-server push: a server sends its output for a step straight to the next server of the
client's chain, so one step costs one pass along the chain instead of a round trip per server.

Streams to next hops are kept open and shared by all sessions going that way. A push that cannot
be delivered is dropped with a warning: the client, missing that hop's answer, recovers as from
any failed server.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2P, P2PDaemonError, PeerID

from ...p2p import PUSH_PROTOCOL, PushStep, PushTarget, write_frame

__all__ = ["PushSender"]

logger = logging.getLogger(__name__)


class PushSender:
    def __init__(self, p2p: P2P, timeout_s: float = 10.0):
        self.p2p, self.timeout_s = p2p, timeout_s
        self._writers: dict[str, asyncio.StreamWriter] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def push(self, target: PushTarget, step: PushStep) -> None:
        lock = self._locks.setdefault(target.peer_id_str, asyncio.Lock())
        async with lock:  # one frame at a time per stream; a fresh stream if the kept one broke
            for attempt in range(2):
                try:
                    writer = await self._writer(target.peer_id_str)
                    await asyncio.wait_for(write_frame(writer, step.to_wire()), self.timeout_s)
                    return
                except (P2PDaemonError, ConnectionError, asyncio.TimeoutError, ValueError) as exc:
                    self._drop(target.peer_id_str)
                    if attempt:
                        logger.warning("Could not push a step to %s: %r", target.peer_id_str, exc)

    async def _writer(self, peer_id_str: str) -> asyncio.StreamWriter:
        if peer_id_str not in self._writers:
            _, _, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id_str), PUSH_PROTOCOL), self.timeout_s)
            self._writers[peer_id_str] = writer
        return self._writers[peer_id_str]

    def _drop(self, peer_id_str: str) -> None:
        writer = self._writers.pop(peer_id_str, None)
        if writer is not None:
            writer.close()

    def close(self) -> None:
        for peer_id_str in list(self._writers):
            self._drop(peer_id_str)
