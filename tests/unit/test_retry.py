"""The client's one route/retry loop (client/retry.py) decides from the error's branch: a request
that can never succeed reaches the caller at once, a server's refusal excludes it for this
request, a failing server is banned for a while, a misbehaving one for an hour."""

import asyncio
import math
import time

import pytest

from bloompeer.errors import RequestError
from bloompeer.p2p import ErrorCode, PeerBusyError, PeerMisbehavedError, PeerRefusedError, PeerUnavailableError
from bloompeer.peer.client.errors import MissingBlocksError, RequestTooLargeError
from bloompeer.peer.client.health import MISBEHAVIOR_BAN_S
from bloompeer.peer.client.retry import on_a_route
from bloompeer.peer.client.routing import RequestSize

from .client_fakes import record, swarm_of


def _swarm():
    """'near' is the best route for every block; 'far' the fallback."""
    return swarm_of(record("near", 0, 4), record("far", 0, 4), rtts_s={"near": 0.001, "far": 0.2})


async def _run(swarm, failures: dict, refusals=None, recovery_s=5.0):
    """on_a_route through blocks 0:4 with attempts that raise failures[peer] (once each, or always
    if a list); returns (the peer that answered, the peers tried in order)."""
    tried = []

    async def attempt(plan):
        peer = plan.route[0].peer_id_str
        tried.append(peer)
        failure = failures.get(peer)
        if isinstance(failure, list):
            raise failure[0]
        if failure is not None:
            del failures[peer]
            raise failure
        return peer

    answered = await on_a_route(swarm, 0, 4, attempt, RequestSize(), {} if refusals is None else refusals,
                                wait_s=0.2, recovery_s=recovery_s, poll_period_s=0.05)
    return answered, tried


async def test_a_failing_server_is_banned_for_a_while_and_the_request_goes_elsewhere():
    swarm = _swarm()
    answered, tried = await _run(swarm, {"near": PeerUnavailableError(ErrorCode.TIMEOUT, "no answer", "near")})
    assert (answered, tried) == ("far", ["near", "far"])
    assert swarm.bans.banned() == {"near"}
    assert swarm.bans._until["near"] - time.monotonic() < 10  # a short ban: it may come back


async def test_a_busy_server_is_treated_alike():
    swarm = _swarm()
    answered, _ = await _run(swarm, {"near": PeerBusyError(ErrorCode.BUSY, "no room", "near")})
    assert answered == "far" and swarm.bans.banned() == {"near"}


async def test_a_refusal_excludes_the_server_for_this_request_only():
    swarm, refusals = _swarm(), {}
    refused = PeerRefusedError(ErrorCode.TOO_LARGE, "max_length 300 exceeds this server's limit of 64", "near")
    answered, tried = await _run(swarm, {"near": refused}, refusals)
    assert (answered, tried) == ("far", ["near", "far"])
    assert swarm.bans.banned() == set() and set(refusals) == {"near"}
    assert (await _run(swarm, {}))[0] == "near"  # the next request may use it


async def test_when_every_server_refuses_the_request_fails_at_once_with_their_reason():
    swarm = _swarm()
    failures = {peer: [PeerRefusedError(ErrorCode.TOO_LARGE, "max_length 300 exceeds this server's limit of 64 "
                                        "(bloompeer serve --max-length)", peer)] for peer in ("near", "far")}
    with pytest.raises(RequestTooLargeError) as raised:  # with no end to the recovery window: only failing
        await asyncio.wait_for(_run(swarm, failures, recovery_s=math.inf), 60)  # at once ends it (60 s: a guard)
    assert "refused it" in str(raised.value) and "limit of 64" in str(raised.value)
    assert "--max-length" in str(raised.value)
    assert swarm.bans.banned() == set()


async def test_a_misbehaving_server_is_banned_for_an_hour():
    swarm = _swarm()
    lie = PeerMisbehavedError(ErrorCode.BAD_REQUEST, "returned float16 [1, 2] for float32 [1, 3]", "near")
    answered, _ = await _run(swarm, {"near": lie})
    assert answered == "far" and swarm.bans.banned() == {"near"}
    assert swarm.bans._until["near"] - time.monotonic() > MISBEHAVIOR_BAN_S - 60


async def test_a_request_that_can_never_succeed_reaches_the_caller_at_once_and_blames_nobody():
    swarm = _swarm()
    with pytest.raises(RequestError):
        await _run(swarm, {"near": RequestError("batch 0 is not a batch")})
    assert swarm.bans.banned() == set()


async def test_retrying_ends_with_missing_blocks_naming_the_last_failure():
    swarm = _swarm()
    failures = {peer: [PeerUnavailableError(ErrorCode.NOT_SERVING, "draining", peer)] for peer in ("near", "far")}
    with pytest.raises(MissingBlocksError, match=r"block\(s\) 0:4 of tiny .*draining"):
        await _run(swarm, failures, recovery_s=0.3)
    assert swarm.bans.banned() == {"near", "far"}
