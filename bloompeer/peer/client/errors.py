"""Client-side errors, in the tree drawn in `bloompeer/errors.py`:

    BloompeerError
    ├── RequestError
    │   └── RequestTooLargeError over the limits of every server of some block: it can never succeed as asked
    ├── MissingBlocksError       no usable server covers some blocks, even after waiting
    ├── ClientShutDownError      the client is shutting down: the call was refused, or ended by it
    ├── CallCancelledError       the caller cancelled the call from another thread (its HTTP client left)
    └── SessionClosedError       the inference session was closed before, or while, this call ran
"""

from __future__ import annotations

from ...p2p import BloompeerError, RequestError

__all__ = [
    "CallCancelledError", "ClientShutDownError", "MissingBlocksError", "RequestTooLargeError", "SessionClosedError",
    "block_ranges",
]


class MissingBlocksError(BloompeerError):
    """No usable server for some blocks: none announced, or every one failed or is banned."""

    def __init__(self, model_uid: str, missing: list[int], waited_s: float, last_error: str | None = None,
                 seen: str | None = None):
        """last_error: how the last server tried failed; seen: what the swarm shows for those blocks."""
        self.model_uid, self.missing = model_uid, missing
        reason = f"; the last server to try failed with: {last_error}" if last_error else ""
        reason += f"; on the DHT: {seen}" if seen else ""
        super().__init__(
            f"no usable server in the swarm for block(s) {block_ranges(missing)} of {model_uid} "
            f"(waited {waited_s:.0f} s{reason}). "
            f"Start one with: bloompeer serve --model {model_uid} --blocks {missing[0]}:{missing[-1] + 1} "
            f"--initial-peers ..."
        )


class ClientShutDownError(BloompeerError, RuntimeError):
    """The client is shutting down (or shut down): it refuses new work, and work it was running
    when shutdown began ends with this error rather than never."""


class CallCancelledError(BloompeerError):
    """The call was cancelled from outside the thread that made it (runtime.Cancellation): whoever
    waited for its result no longer does, so its work through the swarm was stopped."""


class SessionClosedError(BloompeerError, RuntimeError):
    """The inference session is closed: it takes no more steps, and a step that was running when it
    closed ends with this error rather than opening sessions on new servers to go on."""


class RequestTooLargeError(RequestError):
    """No server in the swarm takes a request this large; asking again, or elsewhere, cannot help.

    Raised at once, and no server is banned for it: it is the caller's arguments that must change
    (or the servers' limits). `reason` names the limit, the value asked and the flag that sets it.
    """

    def __init__(self, model_uid: str, reason: str):
        self.model_uid, self.reason = model_uid, reason
        super().__init__(f"this request cannot be served by the swarm of {model_uid}: {reason}. "
                         f"Ask for less (fewer new tokens, a shorter prompt or a smaller batch).")


def block_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0:3, 5:6" (half-open, as --blocks takes them)."""
    spans, start = [], indices[0]
    for previous, current in zip(indices, indices[1:] + [None]):
        if current != previous + 1:
            spans.append(f"{start}:{previous + 1}")
            start = current
    return ", ".join(spans)
