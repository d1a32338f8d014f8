"""The error tree: every error bloompeer raises on purpose is a BloompeerError, and the class of
a server's failure says what the caller does (see bloompeer/errors.py)."""

import importlib
import inspect

import pytest

import bloompeer
from bloompeer.errors import BloompeerError, RequestError
from bloompeer.p2p import (
    ErrorCode, PeerBusyError, PeerMisbehavedError, PeerRefusedError, PeerUnavailableError, RemoteError, remote_error,
)

from .test_layering import MODULES



def test_every_bloompeer_exception_is_in_the_tree():
    outside = []
    for name in MODULES:
        if name.startswith("bloompeer.peer.api"):  # HTTP answers (ApiError) are not raised to Python callers
            continue
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name
                    and not issubclass(value, BloompeerError)):
                outside.append(f"{name}.{value.__name__}")
    assert outside == []


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_error_code_maps_to_one_branch(code):
    error = remote_error(code, "it went wrong", "peer-a")
    assert isinstance(error, RemoteError) and error.code is code and error.peer == "peer-a"
    assert isinstance(error, PeerUnavailableError) != isinstance(error, PeerMisbehavedError)
    assert not isinstance(error, RequestError)  # one server's answer never condemns the request
    assert "peer-a" in str(error) and "it went wrong" in str(error)


def test_what_each_code_tells_the_caller():
    assert type(remote_error(ErrorCode.BUSY, "")) is PeerBusyError
    assert type(remote_error(ErrorCode.TOO_LARGE, "")) is PeerRefusedError
    assert type(remote_error(ErrorCode.UNSUPPORTED, "")) is PeerRefusedError
    for code in (ErrorCode.NOT_SERVING, ErrorCode.TIMEOUT, ErrorCode.INTERNAL):
        assert type(remote_error(code, "")) is PeerUnavailableError
    assert type(remote_error(ErrorCode.BAD_REQUEST, "")) is PeerMisbehavedError


def test_user_errors_are_request_errors():
    from bloompeer.blocks.checkpoint import CheckpointError
    from bloompeer.p2p.identity import IdentityError
    from bloompeer.peer.client.errors import RequestTooLargeError

    for cls in (CheckpointError, IdentityError, RequestTooLargeError):
        assert issubclass(cls, RequestError) and issubclass(cls, ValueError)
    assert issubclass(bloompeer.MissingBlocksError, BloompeerError)
    assert not issubclass(bloompeer.MissingBlocksError, RequestError)
