"""The relay self-check: it must pass for a relay with bloompeer's limits and fail for one whose
limits would cut a session (real p2pd daemons on 127.0.0.1)."""

from __future__ import annotations

import logging
import os

from bloompeer.p2p import daemon

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _start_relay(**flags):
    return await daemon._Daemon.with_flags(env=daemon.GO_SINGLE_THREAD, **flags).create(
        host_maddrs=LOOPBACK, force_reachability="public")


async def test_a_relay_with_bloompeers_limits_carries_more_than_libp2ps_default():
    ours = os.environ.get("GOMAXPROCS")
    relay, relaying = await daemon.start_daemon([], LOOPBACK, [], None, False, True, ())
    try:
        assert relaying
        assert await daemon._relays_large_streams(relay)  # start_daemon checked it too; check once more
        if os.path.exists(f"/proc/{relay._child.pid}/environ"):  # Linux: p2pd itself runs single-threaded
            with open(f"/proc/{relay._child.pid}/environ", "rb") as environ:
                assert b"GOMAXPROCS=1" in environ.read().split(b"\0")
        assert os.environ.get("GOMAXPROCS") == ours  # set for the daemon alone, never in this process
    finally:
        await relay.shutdown()


async def test_the_self_check_fails_for_a_relay_with_small_limits():
    relay = await _start_relay(relayDataLimit=100_000, relayTimeLimit="24h")
    try:
        assert not await daemon._relays_large_streams(relay)
    finally:
        await relay.shutdown()


async def test_a_peer_whose_relay_keeps_failing_the_check_runs_without_relaying(monkeypatch, caplog):
    async def always_fails(relay):
        return False

    monkeypatch.setattr(daemon, "_relays_large_streams", always_fails)
    with caplog.at_level(logging.WARNING, logger=daemon.__name__):
        p2p, relaying = await daemon.start_daemon([], LOOPBACK, [], None, False, True, ())
    try:
        assert not relaying
        assert await p2p.get_visible_maddrs()  # a working daemon all the same
        assert "not relaying for peers behind NAT" in caplog.text
    finally:
        await p2p.shutdown()
