"""One peer on the network: a libp2p daemon (hivemind.P2P), a Kademlia DHT node and the block directory.

Every bloompeer process (bootstrap, server, client) has exactly one. The DHT node runs in this
process's event loop on the same daemon, so a server's handlers and its DHT share one peer id
and no extra process is left behind if this one dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Iterator

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, P2PDaemonError

from .daemon import start_daemon, stop_daemon
from .dht import BlockDirectory, make_record_validator
from .errors import BloompeerError
from .identity import IdentityError, load_rsa_identity
from .network_config import NetworkConfig
from .reachability import serve_dialback

__all__ = ["NetworkConfig", "PeerNode", "NetworkError"]

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 3.0


class NetworkError(BloompeerError):
    """The peer could not join the network (no reachable bootstrap peer, identity in use, ...)."""


class PeerNode:
    def __init__(self, p2p: P2P, dht: DHTNode, directory: BlockDirectory, relaying: bool = False):
        self.p2p, self.dht, self.directory = p2p, dht, directory
        self.relaying = relaying  # the daemon relays for peers behind NAT
        self.join_seconds: dict[str, float] = {}  # how long each step of create() took, for startup logs
        self.identity_path: str | None = None  # the key file a restart reads (config.identity_path)
        self._ephemeral_key: bytes | None = None  # or a key for this process's life, kept in memory only
        self._closed = False

    @classmethod
    async def create(cls, config: NetworkConfig, announcing: bool = False) -> PeerNode:
        """Start the daemon and join the DHT. A peer that announces records (a server) gets an RSA
        identity, from config.identity_path or a new one for this process's life, and signs with it.
        A new one lives in memory: its file exists only while a daemon starts, so that a process
        killed later (SIGKILL, the OOM killer) leaves no private key behind in the temp directory."""
        if not announcing or config.identity_path is not None:
            return await cls._start(config, announcing, check_identity=True)
        with _key_file(None) as path:
            node = await cls._start(dataclasses.replace(config, identity_path=path), announcing, check_identity=True)
            with open(path, "rb") as file:
                node._ephemeral_key = file.read()
        node.identity_path = None
        return node

    async def rejoin(self, config: NetworkConfig) -> PeerNode:
        """This peer, with the same identity, on a new daemon started with `config` (e.g. other
        relays): this node shuts down first (its connections and streams end), then the new one
        starts. Raises NetworkError if it cannot; this node is shut down either way."""
        path, key = self.identity_path, self._ephemeral_key
        await self.shutdown()
        announcing = path is not None or key is not None
        with _key_file(key) if key is not None else contextlib.nullcontext(path) as identity_path:
            node = await self._start(dataclasses.replace(config, identity_path=identity_path), announcing,
                                     check_identity=False)
        node.identity_path, node._ephemeral_key = path, key
        return node

    @classmethod
    async def _start(cls, config: NetworkConfig, announcing: bool, check_identity: bool) -> PeerNode:
        started = time.monotonic()
        try:
            p2p, relaying = await start_daemon(config.initial_peers, config.host_maddrs, config.announce_maddrs,
                                               config.identity_path, config.client_mode, config.relay_for_others,
                                               config.relays, check_identity)
        except P2PDaemonError as exc:
            raise NetworkError(f"could not start the libp2p daemon: {exc}") from exc
        except (ValueError, RuntimeError) as exc:
            raise NetworkError(f"bad network settings: {exc}") from exc
        daemon_up = time.monotonic()
        try:
            if not config.client_mode:
                await serve_dialback(p2p)
            signing_key = load_rsa_identity(config.identity_path) if announcing else None
            validator, subkey = make_record_validator(signing_key)
            dht = await DHTNode.create(
                p2p=p2p, initial_peers=list(config.initial_peers), client_mode=config.client_mode,
                record_validator=validator, ensure_bootstrap_success=bool(config.initial_peers),
            )
        except BaseException as exc:
            await p2p.shutdown()
            if isinstance(exc, IdentityError):
                raise
            if isinstance(exc, Exception):
                raise NetworkError(f"could not join the DHT through {list(config.initial_peers)}: {exc}") from exc
            raise
        node = cls(p2p, dht, BlockDirectory(dht, subkey, config.dht_timeout_s), relaying)
        node.identity_path = config.identity_path
        node.join_seconds = {"libp2p daemon": daemon_up - started, "DHT": time.monotonic() - daemon_up}
        return node

    @property
    def peer_id_str(self) -> str:
        return self.p2p.peer_id.to_base58()

    @property
    def daemon_alive(self) -> bool:
        """False once the p2pd process has exited (e.g. killed along with our process group)."""
        child = getattr(self.p2p, "_child", None)  # hivemind keeps the daemon's process here
        return child is not None and child.returncode is None

    async def unless_daemon_gone(self, goodbye: Awaitable[object]) -> None:
        """Await a last word to the network at shutdown (announce offline, unregister handlers),
        skipped or cut short if the daemon is gone. When our whole process group gets SIGTERM the
        daemon dies with us, and may do so between `daemon_alive` saying yes (it has not been reaped
        yet) and the call; its control socket is then gone (FileNotFoundError). That is the expected
        end of such a shutdown, not an error."""
        if not self.daemon_alive:
            if asyncio.iscoroutine(goodbye):
                goodbye.close()
            return
        try:
            await goodbye
        except (OSError, P2PDaemonError) as exc:
            logger.debug("The daemon was gone before our last word to the network: %r", exc)

    async def visible_maddrs(self) -> list[str]:
        """The addresses the daemon tells others now (asked afresh: a peer behind NAT gets its
        relays' circuit addresses only once it holds reservations); none yet: []."""
        try:
            return [str(maddr) for maddr in await self.p2p.get_visible_maddrs(latest=True)]
        except ValueError:  # hivemind's "No multiaddrs found"
            return []

    async def shutdown(self) -> None:
        """Stop the DHT node, then the daemon. Idempotent, and bounded in time: hivemind's DHT
        shutdown talks to the daemon and would wait forever for one that already died (as it does
        when a whole process group gets SIGTERM)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.daemon_alive:
                await asyncio.wait_for(self.dht.shutdown(), SHUTDOWN_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("The DHT node did not stop within %.0f s; stopping the daemon anyway", SHUTDOWN_TIMEOUT_S)
        finally:
            await stop_daemon(self.p2p)


@contextlib.contextmanager
def _key_file(key: bytes | None) -> Iterator[str]:
    """The path of a private temporary file holding `key` (None: no file yet, for hivemind to write
    a new RSA identity there), removed with its directory on leaving."""
    with tempfile.TemporaryDirectory(prefix="bloompeer-identity-") as directory:
        path = os.path.join(directory, "identity.key")
        if key is not None:
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
                file.write(key)
        yield path
