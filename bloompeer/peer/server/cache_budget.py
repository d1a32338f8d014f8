"""The server's attention-cache memory: a fixed budget (the memory plan's, memory_plan.py), handed
out whole to sessions as they open.

A session reserves batch x max_length tokens of cache for its blocks when it opens, and batch rows of
its recurrent blocks' state (a cost per session, whatever its length: Gated DeltaNet's), never more
later, so a server that accepted a session can always finish it. The room announced is in tokens: what
one more session of one row could still take after its state. An open that does not
fit waits for sessions to close, up to the client's allocation timeout.
"""

from __future__ import annotations

import asyncio

from ...p2p import ErrorCode, ProtocolError

__all__ = ["CacheBudget"]


class CacheBudget:
    def __init__(self, total_bytes: int, bytes_per_token: int, bytes_per_session: int = 0):
        """bytes_per_token: cache bytes of one token over the server's whole span (sizes the announcements);
        bytes_per_session: what a session of one row takes there whatever its length (its recurrent state)."""
        self.total_bytes, self.bytes_per_token, self.bytes_per_session = total_bytes, bytes_per_token, bytes_per_session
        self.used_bytes = 0
        self.waiting = 0  # opens waiting for room now
        self._changed = asyncio.Condition()

    @property
    def tokens_left(self) -> int:
        return max(0, self.total_bytes - self.used_bytes - self.bytes_per_session) // self.bytes_per_token

    @property
    def recurrent_only(self) -> bool:
        """Whether no served block caches per token (all recurrent): a token then costs only its byte of padding
        mask, and counting the budget in tokens says nothing (billions of them)."""
        return self.bytes_per_token <= 1

    def room(self) -> str:
        """What the budget holds, as a server's start-up log says it."""
        if not self.bytes_per_session:
            return f"{self.tokens_left} tokens"
        sessions = (f"{self.total_bytes // self.bytes_per_session} one-row sessions' recurrent state "
                    f"({self.bytes_per_session / 2**20:.2f} MiB each)")
        return sessions if self.recurrent_only else f"{self.tokens_left} tokens, or {sessions}"

    def _describe(self, nbytes: int) -> str:
        if self.recurrent_only:
            return (f"asked for {nbytes / 2**20:.1f} MiB of session state, {(self.total_bytes - self.used_bytes) / 2**20:.1f}"
                    f" of {self.total_bytes / 2**20:.1f} MiB are free")
        tokens = max(0, nbytes - self.bytes_per_session) // self.bytes_per_token
        return (f"asked for {tokens} tokens of cache, {self.tokens_left} of "
                f"{max(0, self.total_bytes - self.bytes_per_session) // self.bytes_per_token} are free")

    async def reserve(self, nbytes: int, timeout_s: float) -> None:
        """Take `nbytes`, waiting up to `timeout_s` for other sessions to free them."""
        if nbytes > self.total_bytes:
            raise ProtocolError(f"too large for this server: {self._describe(nbytes)} (bloompeer serve --cache-tokens)",
                                ErrorCode.TOO_LARGE)

        def fits() -> bool:
            return self.used_bytes + nbytes <= self.total_bytes

        async with self._changed:
            try:
                if not fits():
                    self.waiting += 1
                    try:
                        await asyncio.wait_for(self._changed.wait_for(fits), timeout_s)
                    finally:
                        self.waiting -= 1
            except asyncio.TimeoutError:
                raise ProtocolError(f"no room after waiting {timeout_s:.1f} s: {self._describe(nbytes)}",
                                    ErrorCode.BUSY) from None
            self.used_bytes += nbytes

    async def release(self, nbytes: int) -> None:
        async with self._changed:
            self.used_bytes -= nbytes
            self._changed.notify_all()
