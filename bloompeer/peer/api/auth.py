"""API keys: with keys set (`bloompeer api --api-key KEY`), every request needs one of them.

/v1 requests carry it as OpenAI clients send theirs, `Authorization: Bearer KEY`, and are
answered 401 in OpenAI's error shape without it. The dashboard, its data and /metrics follow the
same rule unless the dashboard is public (`--public-dashboard`); since a browser cannot be told
to send a bearer token, they also take the key as the password of HTTP basic authentication
(any user name), and their 401 asks the browser for it. /health never needs a key: probes hold
none, and it tells only whether every block is served. Keys are compared in constant time.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from .openai_schema import error_body

__all__ = ["ApiAccess", "RequireApiKey", "is_loopback"]

OPENAI_PREFIX = "/v1"
HEALTH_PATH = "/health"  # a probe holds no key; it learns only whether every block is served


@dataclass(frozen=True)
class ApiAccess:
    keys: frozenset[str] = frozenset()  # empty: anyone who reaches the port may use the API
    public_dashboard: bool = False  # the dashboard, /api/swarm and /metrics need no key

    def needs_key(self, path: str) -> bool:
        if not self.keys or path == HEALTH_PATH:
            return False
        return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/") or not self.public_dashboard

    def accepts(self, authorization: str | None) -> bool:
        key = _presented_key(authorization)
        if key is None:
            return False
        matches = [hmac.compare_digest(key.encode(), known.encode()) for known in self.keys]  # no early exit
        return any(matches)


def _presented_key(authorization: str | None) -> str | None:
    """The key in an Authorization header: `Bearer KEY`, or basic authentication with KEY as password."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer":
        return credentials.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(credentials.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return None
    return None


class RequireApiKey:
    """ASGI middleware: a request that needs a key (ApiAccess.needs_key) and lacks a valid one gets 401."""

    def __init__(self, app, access: ApiAccess):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.access.needs_key(scope["path"]):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        if self.access.accepts(authorization):
            return await self.app(scope, receive, send)
        await _unauthorized(scope["path"], authorization is not None)(scope, receive, send)


def _unauthorized(path: str, key_given: bool) -> JSONResponse:
    if key_given:
        message = "Incorrect API key provided. Use a key this server was started with (bloompeer api --api-key)."
    else:
        message = ("You didn't provide an API key. Send it as 'Authorization: Bearer KEY' (the openai client's "
                   "api_key; for lm-eval, $OPENAI_API_KEY).")
    openai_path = path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")
    challenge = "Bearer" if openai_path else 'Basic realm="bloompeer", charset="UTF-8"'
    return JSONResponse(error_body(message, "invalid_request_error", code="invalid_api_key"), status_code=401,
                        headers={"WWW-Authenticate": challenge})


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the API on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface
