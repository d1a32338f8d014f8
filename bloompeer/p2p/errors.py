"""Errors that cross the wire: the stable codes of error frames and the classes they map to.

Where these sit in bloompeer's error tree, and what a caller does with each, is drawn in
`bloompeer/errors.py`. `remote_error` is the only place that maps a code to a class.
"""

from __future__ import annotations

from enum import Enum

from ..errors import BloompeerError, RequestError

__all__ = [
    "BloompeerError", "ErrorCode", "PeerBusyError", "PeerMisbehavedError", "PeerRefusedError", "PeerUnavailableError",
    "ProtocolError", "RemoteError", "RequestError",
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
    """One server failed one request: it answered an error frame, went silent, lost the stream or
    sent something invalid. `peer` names the server; `code` is the error frame's (or the closest) code."""

    def __init__(self, code: ErrorCode, message: str, peer: str = "?"):
        super().__init__(f"{peer} answered {code.value}: {message}")
        self.code, self.remote_message, self.peer = code, message, peer


class PeerUnavailableError(RemoteError):
    """This server cannot serve the request now (draining, wrong blocks, timed out, stream lost,
    internal failure): route around it and replay. Not the request's fault, nor a sign of malice."""


class PeerBusyError(PeerUnavailableError):
    """The server has no room for this request now; it may later."""


class PeerRefusedError(PeerUnavailableError):
    """The request is over this server's limits (or asks what it does not do): a caller avoids the
    server for this request only, and does not ban it, as the next request may fit."""


class PeerMisbehavedError(RemoteError):
    """The server broke the protocol: it called a valid request bad, or sent an invalid, ill-shaped
    or wrong answer. A caller bans it."""


_CLASS_OF_CODE: dict[ErrorCode, type[RemoteError]] = {
    ErrorCode.BUSY: PeerBusyError,
    ErrorCode.TOO_LARGE: PeerRefusedError,
    ErrorCode.UNSUPPORTED: PeerRefusedError,
    ErrorCode.NOT_SERVING: PeerUnavailableError,
    ErrorCode.TIMEOUT: PeerUnavailableError,
    ErrorCode.INTERNAL: PeerUnavailableError,
    ErrorCode.BAD_REQUEST: PeerMisbehavedError,  # our client sends only valid requests (it checks them first)
}


def remote_error(code: ErrorCode, message: str, peer: str = "?") -> RemoteError:
    """The exception that an error frame with `code` from `peer` maps to."""
    return _CLASS_OF_CODE[code](code, message, peer)
