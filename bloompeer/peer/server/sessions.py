"""Open inference sessions: their caches, who owns them, and when they are freed.

A session is freed when its client closes it, when its stream ends (the client went away), and
after `session_timeout_s` without a step, so an abandoned session never holds memory for long. A
session with a step being checked or computed is not idle, however long the step waits in a busy
server's queue.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ...blocks import SessionCache
from ...p2p import ErrorCode, Message, ProtocolError
from .cache_budget import CacheBudget

__all__ = ["Session", "SessionRegistry"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    # the session's one name: random and unguessable, it is the session_id its client gets on the
    # wire, gives the servers before this one in its chain to push steps here, and is what the
    # scheduler tells the session's steps apart by
    id: str
    peer_id_str: str
    cache: SessionCache
    nbytes: int
    on_expire: Callable[[], None]  # ends the session's stream
    deliver: Callable[[Message], Awaitable[None]]  # answers the session's client, on its stream
    last_active: float = field(default_factory=time.monotonic)
    # held while a step is checked and computed: a session's steps (from its client and pushed) run
    # one at a time, in arrival order, each checked against the cache as the one before left it
    stepping: asyncio.Lock = field(default_factory=asyncio.Lock)

    def touch(self) -> None:
        self.last_active = time.monotonic()


class SessionRegistry:
    def __init__(self, budget: CacheBudget, max_sessions_per_peer: int, session_timeout_s: float):
        self.budget, self.max_sessions_per_peer, self.session_timeout_s = (
            budget, max_sessions_per_peer, session_timeout_s)
        self.sessions: set[Session] = set()
        self._by_id: dict[str, Session] = {}
        self._per_peer: Counter[str] = Counter()

    async def open(self, peer_id_str: str, nbytes: int, alloc_timeout_s: float,
                   make_cache: Callable[[], SessionCache], on_expire: Callable[[], None],
                   deliver: Callable[[Message], Awaitable[None]]) -> Session:
        """Reserve the session's memory (waiting up to alloc_timeout_s), then allocate its cache."""
        if self._per_peer[peer_id_str] >= self.max_sessions_per_peer:
            raise ProtocolError(f"this peer already has {self.max_sessions_per_peer} open sessions here, "
                                f"the limit per peer", ErrorCode.BUSY)
        self._per_peer[peer_id_str] += 1  # counted while waiting, so a peer cannot queue many opens
        try:
            await self.budget.reserve(nbytes, alloc_timeout_s)
        except BaseException:
            self._forget_peer(peer_id_str)
            raise
        try:
            cache = make_cache()
        except BaseException:
            self._forget_peer(peer_id_str)
            await self.budget.release(nbytes)
            raise
        session = Session(secrets.token_hex(16), peer_id_str, cache, nbytes, on_expire, deliver)
        self.sessions.add(session)
        self._by_id[session.id] = session
        return session

    def find(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def _forget_peer(self, peer_id_str: str) -> None:
        self._per_peer[peer_id_str] -= 1
        if not self._per_peer[peer_id_str]:
            del self._per_peer[peer_id_str]

    async def close(self, session: Session) -> None:
        """Free the session's cache. Idempotent."""
        if session not in self.sessions:
            return
        self.sessions.discard(session)
        del self._by_id[session.id]
        self._forget_peer(session.peer_id_str)
        session.cache = None  # drop the tensors now, not when the stream object goes
        await self.budget.release(session.nbytes)

    async def expire_idle(self) -> None:
        """Every few seconds, end sessions idle for longer than the timeout (run as a task); not one
        whose step is under way (it touches the session when done)."""
        while True:
            await asyncio.sleep(min(5.0, self.session_timeout_s / 2))
            now = time.monotonic()
            for session in [s for s in self.sessions
                            if now - s.last_active > self.session_timeout_s and not s.stepping.locked()]:
                # a prefix of its id: the whole id lets whoever reads it push steps into the session
                logger.info("Closing session %s of %s: idle for over %.0f s", session.id[:8], session.peer_id_str,
                            self.session_timeout_s)
                session.on_expire()
                await self.close(session)
