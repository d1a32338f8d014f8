"""Starting the libp2p daemon (p2pd, through hivemind.P2P) with the relay settings bloompeer needs.

Three kinds of peers:
  - a relay (the bootstrap peer, and servers unless --no-relay): serves as a circuit relay for
    peers behind NAT, with limits bloompeer sets (16 GiB and 24 h per relayed connection) instead
    of libp2p's defaults for limited relays (128 KiB and 2 min, which cut a session after a few
    steps);
  - a peer behind NAT: reserves slots on the relays it knows (auto-relay, static relays, no
    3-minute discovery delay) and announces its circuit addresses;
  - anyone else: a plain daemon.

p2pd registers two relay services on one protocol, the configured one and go-libp2p's default,
and the last to register serves (see ../shared/hivemind-notes.md, section 3b). With GOMAXPROCS=1
the configured one won 36 of 36 starts there; start_daemon also checks that a relayed stream
carries more than the default limit, and restarts the relay daemon if it does not (after three
failures the peer runs without relaying, rather than relaying with limits that break sessions).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from typing import ClassVar

from hivemind.p2p import P2P, P2PDaemonError, PeerID

from .framing import read_frame, write_frame

__all__ = ["start_daemon", "stop_daemon", "RELAY_DATA_LIMIT", "RELAY_TIME_LIMIT"]

logger = logging.getLogger(__name__)

RELAY_DATA_LIMIT = 16 << 30  # bytes per relayed connection and direction
RELAY_TIME_LIMIT = "24h"
RELAY_START_ATTEMPTS = 3
SELF_CHECK_BYTES = 512 << 10  # more than go-libp2p's default limit of 128 KiB
SELF_CHECK_OPEN_S = 10.0
DAEMON_STOP_S = 3.0  # after SIGTERM, how long p2pd gets to exit before it is killed
_SELF_CHECK_PROTOCOL = "bloompeer.relay-check/1"
LOOPBACK_IPS = ("/ip4/127.0.0.1/", "/ip6/::1/")
GO_SINGLE_THREAD = {"GOMAXPROCS": "1"}  # a relay's p2pd: its configured relay service wins (module docstring)


class _Daemon(P2P):
    """hivemind's P2P with daemon flags that P2P.create does not take, and environment variables for
    the daemon alone: hivemind starts p2pd with a copy of our environment and takes no other, and
    setting os.environ around the start would race with other threads of this process that start
    daemons (an API server's clients), so p2pd is started through env(1), which execs it in place."""

    extra_flags: ClassVar[dict] = {}
    extra_env: ClassVar[dict] = {}

    def _make_process_args(self, *args, **kwargs):
        process_args = P2P._make_process_args(*args, **{**kwargs, **self.extra_flags})
        if not self.extra_env:
            return process_args
        return ["env", *(f"{name}={value}" for name, value in self.extra_env.items()), *process_args]

    @classmethod
    def with_flags(cls, env: dict[str, str] | None = None, **flags) -> type[_Daemon]:
        return type("Daemon", (cls,), {"extra_flags": flags, "extra_env": env or {}})

    @classmethod
    async def is_identity_taken(cls, identity_path: str, **kwargs) -> bool:
        """hivemind asks a throwaway daemon, started through `cls`: a plain one here, since ours
        with static relays (-relayDiscovery=0) and none named would refuse to start."""
        return await P2P.is_identity_taken(identity_path, **{**kwargs, "use_auto_relay": False})


async def start_daemon(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
                       identity_path: str | None, dht_client: bool, relay_for_others: bool,
                       relays: Sequence[str], check_identity: bool = True) -> tuple[P2P, bool]:
    """(the daemon, whether it relays for others). relay_for_others: be a relay (forced publicly
    reachable), unless its self-check keeps failing; relays: we are behind NAT, reached through
    these (a reservation on each: libp2p's static relays); check_identity: make sure no live peer
    uses identity_path's key (skipped when we just stopped the daemon that used it)."""
    common = dict(initial_peers=list(initial_peers), host_maddrs=list(host_maddrs), identity_path=identity_path,
                  dht_mode="client" if dht_client else "server", check_if_identity_free=check_identity)
    if relays:
        daemon = _Daemon.with_flags(relayDiscovery=0)
        return await daemon.create(**common, use_auto_relay=True, trusted_relays=list(relays),
                                   force_reachability="private",
                                   announce_maddrs=[f"{relay}/p2p-circuit" for relay in relays]), False
    if not relay_for_others:
        return await P2P.create(**common, announce_maddrs=list(announce_maddrs) or None), False
    daemon = _Daemon.with_flags(env=GO_SINGLE_THREAD, relayDataLimit=RELAY_DATA_LIMIT, relayTimeLimit=RELAY_TIME_LIMIT)
    for attempt in range(1, RELAY_START_ATTEMPTS + 1):
        p2p = await daemon.create(**common, announce_maddrs=list(announce_maddrs) or None, force_reachability="public")
        if await _relays_large_streams(p2p):
            return p2p, True
        logger.warning("The relay service came up with libp2p's default limits (attempt %d of %d); restarting",
                       attempt, RELAY_START_ATTEMPTS)
        await p2p.shutdown()
    logger.warning("Could not start a relay with bloompeer's limits; not relaying for peers behind NAT")
    return await P2P.create(**common, announce_maddrs=list(announce_maddrs) or None), False


async def stop_daemon(p2p: P2P, timeout_s: float = DAEMON_STOP_S) -> None:
    """hivemind's P2P.shutdown: SIGTERM to p2pd, then a wait for it without end. A peer's exit must
    not hang on a daemon that is slow to close its connections, so after `timeout_s` it is killed."""
    try:
        await asyncio.wait_for(p2p.shutdown(), timeout_s)
    except asyncio.TimeoutError:
        child = p2p._child  # hivemind keeps the daemon's process here
        logger.warning("p2pd (pid %d) did not exit within %.0f s of SIGTERM; killing it", child.pid, timeout_s)
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()


async def _open_when_routable(behind: P2P, hidden: PeerID):
    """A stream to `hidden` through the relay. Just after the peers start, `behind` may not know a
    route to `hidden` yet ("failed to find any peer in table") or `hidden` may not hold its
    reservation yet: both pass within moments, so opening is retried until SELF_CHECK_OPEN_S."""
    deadline = asyncio.get_running_loop().time() + SELF_CHECK_OPEN_S
    while True:
        try:
            return await asyncio.wait_for(behind.call_binary_stream_handler(hidden, _SELF_CHECK_PROTOCOL), 5)
        except (P2PDaemonError, asyncio.TimeoutError) as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise
            logger.debug("Relay self-check: no stream yet (%r); retrying", exc)
            await asyncio.sleep(0.1)


async def _relays_large_streams(relay: P2P) -> bool:
    """Send more than libp2p's default relay limit through `relay`, between two throwaway peers."""
    loopback = [str(a) for a in await relay.get_visible_maddrs() if any(ip in str(a) for ip in LOOPBACK_IPS)]
    if not loopback:
        logger.warning("The relay has no loopback address to check itself through; not checked")
        return True
    hidden = behind = None
    try:
        hidden = await _Daemon.with_flags(relayDiscovery=0).create(
            initial_peers=loopback, use_auto_relay=True, trusted_relays=loopback, force_reachability="private",
            no_listen=True, announce_maddrs=[f"{loopback[0]}/p2p-circuit"], dht_mode="client")

        async def echo(info, reader, writer):
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    await write_frame(writer, await read_frame(reader))

        await hidden.add_binary_stream_handler(_SELF_CHECK_PROTOCOL, echo)
        behind = await P2P.create(initial_peers=loopback, dht_mode="client")
        _, reader, writer = await _open_when_routable(behind, PeerID.from_base58(hidden.peer_id.to_base58()))
        chunk = os.urandom(64 << 10)
        for _ in range(SELF_CHECK_BYTES // len(chunk)):
            await write_frame(writer, {"d": chunk})
            await asyncio.wait_for(read_frame(reader), 10)
        writer.close()
        return True
    except (Exception, asyncio.TimeoutError) as exc:
        logger.debug("Relay self-check failed: %r", exc)
        return False
    finally:
        for peer in (behind, hidden):
            if peer is not None:
                await peer.shutdown()
