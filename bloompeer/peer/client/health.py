"""What the client has learned about servers by using them: round-trip times, and bans.

A server that failed a request is banned for a while, longer each time it fails again, so a
flaky or dying server is tried less and less, but a restarted one is used again eventually. A
server that broke the protocol or lied is banned for an hour at once: a second chance would
cost the user a wrong or failed answer again.
"""

from __future__ import annotations

import logging
import time

from ...p2p import ping

__all__ = ["BanList", "MISBEHAVIOR_BAN_S", "ping"]

logger = logging.getLogger(__name__)


MISBEHAVIOR_BAN_S = 3600.0  # a server caught breaking the protocol or lying


class BanList:
    """The servers this client avoids for now, and until when. One per client (its SwarmView's),
    shared by every session and request, so what one call learned spares the others."""

    def __init__(self, first_ban_s: float = 5.0, max_ban_s: float = 300.0):
        self.first_ban_s, self.max_ban_s = first_ban_s, max_ban_s
        self._until: dict[str, float] = {}
        self._next_ban_s: dict[str, float] = {}

    def ban(self, peer_id_str: str, reason: str, duration_s: float | None = None) -> None:
        """Avoid the peer for `duration_s`, or by default for twice as long as the last time."""
        if duration_s is None:
            duration_s = self._next_ban_s.get(peer_id_str, self.first_ban_s)
            self._next_ban_s[peer_id_str] = min(2 * duration_s, self.max_ban_s)
        self._until[peer_id_str] = max(self._until.get(peer_id_str, 0.0), time.monotonic() + duration_s)
        logger.warning("Not using server %s for %.0f s: %s", peer_id_str, duration_s, reason)

    def banned(self) -> set[str]:
        now = time.monotonic()
        return {peer for peer, until in self._until.items() if until > now}
