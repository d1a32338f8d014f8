"""When a server stores its DHT record again: once soon after going online, then every period."""

import asyncio
from types import SimpleNamespace

import pytest

from bloompeer.peer.server import server as server_module
from bloompeer.peer.server.server import REANNOUNCE_AFTER_JOINING_S, Server

PERIOD_S = 30.0


async def test_the_record_is_stored_again_soon_after_going_online_then_every_period(monkeypatch):
    events = []

    async def sleep(seconds):
        events.append(seconds)
        if events.count("announce") == 3:
            raise asyncio.CancelledError

    async def announce():
        events.append("announce")

    monkeypatch.setattr(server_module.asyncio, "sleep", sleep)
    server = SimpleNamespace(config=SimpleNamespace(announce_period_s=PERIOD_S), announce=announce)
    with pytest.raises(asyncio.CancelledError):
        await Server._announce_periodically(server)
    assert REANNOUNCE_AFTER_JOINING_S < PERIOD_S
    assert events == [REANNOUNCE_AFTER_JOINING_S, "announce", PERIOD_S, "announce", PERIOD_S, "announce", PERIOD_S]
