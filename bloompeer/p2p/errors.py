"""Errors that cross the wire: the stable codes of error frames and the classes they map to.

Where these sit in bloompeer's error tree, and what a caller does with each, is drawn in
`bloompeer/errors.py`.
"""

from __future__ import annotations

from enum import Enum

from ..errors import BloompeerError

__all__ = [
    "BloompeerError", "ErrorCode", "PeerBusyError", "PeerRefusedError", "PeerUnavailableError", "ProtocolError",
    "RemoteError",
    "remote_error",
]


class ErrorCode(str, Enum):
    """The stable codes of error frames. Clients branch on these, never on message text."""

    BAD_REQUEST = "bad_request"  # malformed frame, unknown or ill-typed field, shape that does not fit
    UNSUPPORTED = "unsupported"  # well formed, but asks for something this server does not do
    TOO_LARGE = "too_large"  # over a size limit (frame bytes, tokens, batch, max_length)
    BUSY = "busy"  # no room now (cache budget, sessions per peer); retry elsewhere or later
    TIMEOUT = "timeout"  # the peer waited too long for the other side
    NOT_SERVING = "not_serving"  # wrong model or blocks, or the server is draining
    INTERNAL = "internal"  # a bug or an unexpected failure on the peer; the stream stays usable


class ProtocolError(BloompeerError):
    """A peer sent data we refuse to act on. `code` is what an error frame back would carry."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST):
        super().__init__(message)
        self.code = code


class RemoteError(BloompeerError):
    """A peer answered a request with an error frame."""

    def __init__(self, code: ErrorCode, message: str, peer: str = "?"):
        super().__init__(f"{peer} answered {code.value}: {message}")
        self.code, self.remote_message, self.peer = code, message, peer


class PeerBusyError(RemoteError):
    """The peer has no room for this request now."""


class PeerRefusedError(RemoteError):
    """The request is over this peer's limits: a caller avoids the peer for this request only."""


class PeerUnavailableError(RemoteError):
    """The peer cannot serve this request (draining, wrong blocks, timed out, stream lost)."""


def remote_error(code: ErrorCode, message: str, peer: str = "?") -> RemoteError:
    """The exception that an error frame with `code` maps to."""
    if code is ErrorCode.BUSY:
        return PeerBusyError(code, message, peer)
    if code is ErrorCode.TOO_LARGE:
        return PeerRefusedError(code, message, peer)
    if code in (ErrorCode.NOT_SERVING, ErrorCode.TIMEOUT):
        return PeerUnavailableError(code, message, peer)
    return RemoteError(code, message, peer)
