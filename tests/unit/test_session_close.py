"""Closing an inference session, also while one of its steps runs (the API closes a generation's
session when its HTTP client leaves; a shutdown closes them all): afterwards nothing is opened on
the servers in its name, every server session it opened is closed, and the step in flight ends
with SessionClosedError rather than going on through new servers."""

import asyncio

import pytest
import torch

from bloompeer.p2p import ErrorCode, PeerUnavailableError
from bloompeer.peer.client import inference_session
from bloompeer.peer.client.config import ClientConfig
from bloompeer.peer.client.errors import SessionClosedError
from bloompeer.peer.client.inference_session import InferenceSession

from .client_fakes import FakeServers, record, swarm_of

CONFIG = ClientConfig(recovery_timeout_s=5.0, missing_blocks_timeout_s=5.0, poll_period_s=0.05)


class Gate:
    """Where a fake server stops until the test lets it go on."""

    def __init__(self, peer: str):
        self.peer, self.reached, self.opened = peer, asyncio.Event(), asyncio.Event()

    async def stop_here(self, peer: str) -> None:
        if peer == self.peer:
            self.reached.set()
            await self.opened.wait()


@pytest.fixture
def servers():
    return FakeServers()


def _gated(monkeypatch, servers: FakeServers, opening: Gate | None = None, receiving: Gate | None = None):
    """Fake server sessions that stop at `opening` (while a peer's session opens) or at `receiving`
    (before a peer's answer, which is then a lost stream, as when the session was closed under it)."""
    fake = servers.session_class()

    class GatedSession(fake):
        @classmethod
        async def open(cls, p2p, route, *args):
            if opening is not None:
                await opening.stop_here(route.peer_id_str)
            return await super().open(p2p, route, *args)

        async def receive(self, step_id, like):
            if receiving is not None and receiving.peer == self.route.peer_id_str:
                await receiving.stop_here(self.route.peer_id_str)
                raise PeerUnavailableError(ErrorCode.NOT_SERVING, "stream closed", self.route.peer_id_str)
            return await super().receive(step_id, like)

    monkeypatch.setattr(inference_session, "SpanInferenceSession", GatedSession)


def _session():
    swarm = swarm_of(record("head", 0, 2), record("spare", 0, 2), record("tail", 2, 4), record("spare-tail", 2, 4),
                     rtts_s={"head": 0.001, "spare": 0.5, "tail": 0.001, "spare-tail": 0.5})
    return InferenceSession(None, swarm, CONFIG, max_length=16)


def _peers(routes) -> set[str]:
    return {route.peer_id_str for route in routes}


async def test_a_closed_session_neither_steps_nor_opens_again(monkeypatch, servers):
    _gated(monkeypatch, servers)
    session = _session()
    await session.close()
    with pytest.raises(SessionClosedError, match="opened again"):
        await session.open(batch=1)
    with pytest.raises(SessionClosedError, match="no more steps"):
        await session.step(torch.zeros(1, 1, 1))
    assert servers.opened == []


async def test_closing_while_a_step_recovers_closes_the_new_servers_session_and_ends_the_step(monkeypatch, servers):
    opening = Gate("spare")
    _gated(monkeypatch, servers, opening=opening)
    session = _session()
    await session.step(torch.ones(1, 3, 1))
    servers.fail_next["head"] = 1
    step = asyncio.ensure_future(session.step(torch.ones(1, 1, 1)))
    await opening.reached.wait()  # head failed; its replacement is being opened
    await session.close()
    opening.opened.set()

    with pytest.raises(SessionClosedError, match="closed again"):
        await step
    assert _peers(servers.opened) == {"head", "tail", "spare"}
    assert _peers(servers.closed) == _peers(servers.opened)  # the replacement too: nobody else would close it


async def test_a_step_that_fails_because_its_session_closed_opens_no_new_servers(monkeypatch, servers):
    receiving = Gate("tail")
    _gated(monkeypatch, servers, receiving=receiving)
    session = _session()
    session.push = False
    step = asyncio.ensure_future(session.step(torch.ones(1, 2, 1)))
    await receiving.reached.wait()  # the step waits for tail's answer
    await session.close()
    receiving.opened.set()  # ... which is the stream lost, as closing it does

    with pytest.raises(SessionClosedError, match="failed as it closed"):
        await step
    assert _peers(servers.opened) == {"head", "tail"}  # not spare-tail
    assert session.swarm.bans.banned() == set()  # and tail is not blamed for the close


async def test_a_step_cancelled_while_its_route_opens_closes_the_sessions_that_opened(monkeypatch, servers):
    """A caller that leaves (its HTTP client did) cancels the step; the span whose session had opened
    by then must be closed too, not left holding cache on its server until the session times out."""
    opening = Gate("tail")
    _gated(monkeypatch, servers, opening=opening)
    session = _session()
    step = asyncio.ensure_future(session.step(torch.ones(1, 1, 1)))
    await opening.reached.wait()  # head's session is open; tail's is opening
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    assert _peers(servers.opened) == {"head"}
    assert _peers(servers.closed) == {"head"}
