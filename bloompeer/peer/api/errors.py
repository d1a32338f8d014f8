"""HTTP errors in OpenAI's shape, and the one place bloompeer's exceptions become HTTP statuses.

    400 invalid_request_error   a parameter is invalid or unsupported; over_swarm_limits: the request
                                is over every server's announced limits (the client's routing finds
                                that from the servers' DHT records, before anything is sent)
    401 invalid_request_error   invalid_api_key: a key is required and none, or a wrong one, was sent
                                (answered by auth.py, before any handler)
    404 invalid_request_error   model_not_found: the request names a model this API does not serve
    503 service_unavailable     missing_blocks: no server covers some blocks now (they are named);
                                servers_busy: every server that could take the request is full;
                                shutting_down: the API is stopping (SIGTERM) and ended the request
    502 bad_gateway             a server misbehaved and no other could take over
    500 server_error            a bug here
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ...p2p import BloompeerError, PeerBusyError, RemoteError
from ..client.errors import ClientShutDownError, MissingBlocksError, RequestTooLargeError
from .openai_schema import error_body

__all__ = ["ApiError", "api_error_from", "install_error_handlers"]

logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.body = status, error_body(message, error_type, param, code, **extra)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> ApiError:
        return cls(400, message, param=param)


def api_error_from(exc: BaseException) -> ApiError:
    """What an exception out of generate() means for the HTTP client."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MissingBlocksError):
        return ApiError(503, str(exc), "service_unavailable", code="missing_blocks", missing_blocks=exc.missing)
    if isinstance(exc, ClientShutDownError):
        return ApiError(503, f"the API is shutting down: {exc}", "service_unavailable", code="shutting_down")
    if isinstance(exc, PeerBusyError):
        return ApiError(503, f"the swarm is busy, retry later: {exc}", "service_unavailable", code="servers_busy")
    if isinstance(exc, RequestTooLargeError):
        return ApiError(400, str(exc), param="max_tokens", code="over_swarm_limits")
    if isinstance(exc, ValueError):
        return ApiError.invalid(str(exc))
    if isinstance(exc, (RemoteError, BloompeerError)):
        return ApiError(502, f"the swarm could not complete the request: {exc}", "bad_gateway")
    logger.error("Request failed", exc_info=exc)
    return ApiError(500, f"internal error: {exc!r}", "server_error")


def _validation_message(error: dict) -> tuple[str, str | None]:
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    return (f"{param}: {error.get('msg')}" if param else str(error.get("msg"))), param


def install_error_handlers(app) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors()[0]) if exc.errors() else ("invalid request body", None)
        return ApiError.invalid(message, param).response()
