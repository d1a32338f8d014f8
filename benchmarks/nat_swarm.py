"""The churn benchmark's swarm across a NAT (root only): tests/nat/netns.py's namespaces, with the
bootstrap peer, the directly reachable servers and the clients on the public host, and each
relayed server in a home of its own behind a masquerading router.

The bootstrap peer relays for nobody (--no-relay), so a server behind NAT holds its slots on
servers that offer to relay in their records, and loses one whenever the churn kills one of them.
The benchmark runs in the host's own namespace and reaches each peer's metrics port inside the
peer's namespace (`scrape_context`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from bloompeer.peer.cli.local_swarm import BLOOMPEER_COMMAND, PeerProcess, stop_in_parallel
from tests.nat.netns import NatTopology

__all__ = ["MAX_RELAYED", "NatSwarm", "relay_figures", "relayed_servers", "why_not_relayed"]

ANY_ADDRESS = "/ip4/0.0.0.0/tcp/0"
MAX_RELAYED = 8  # homes: their routers' WAN addresses (.2 ...) must stay below the public host's (.10)
CLONE_NEWNET = 0x40000000


def why_not_relayed() -> str | None:
    """None where this machine can build the namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("iptables") is None:
        return "`ip` or `iptables` is missing"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


@contextlib.contextmanager
def _network_namespace(name: str) -> Iterator[None]:
    """This thread in the named network namespace for a while (sockets opened meanwhile stay in it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net") as own, open(f"/run/netns/{name}") as other:
        if libc.setns(other.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
        try:
            yield
        finally:
            libc.setns(own.fileno(), CLONE_NEWNET)


class NatSwarm:
    """A bootstrap peer on the public host; add_server() starts servers there or behind a home's router."""

    def __init__(self, model: str | Path, relayed: int, log_dir: Path, start_timeout_s: float = 120.0):
        if not 0 < relayed <= MAX_RELAYED:
            raise ValueError(f"between 1 and {MAX_RELAYED} relayed servers, not {relayed}")
        self.model, self.log_dir, self.start_timeout_s = str(model), log_dir, start_timeout_s
        self.homes = tuple(f"h{index}" for index in range(relayed))
        self.topology = NatTopology(homes=self.homes)
        self.bootstrap: PeerProcess | None = None
        self.initial_peers: list[str] = []
        self.servers: list[PeerProcess] = []
        self.namespace_of: dict[int, str] = {}  # pid -> its network namespace

    def __enter__(self) -> NatSwarm:
        self.topology.create()
        try:
            self.bootstrap = self._start("bootstrap", "public", ["dht", "--no-relay", "--host-maddrs", ANY_ADDRESS])
            deadline = time.monotonic() + self.start_timeout_s
            self.initial_peers = [self.bootstrap.wait_for_line(f"/ip4/{self.topology.PUBLIC_IP}/", deadline)]
        except BaseException:
            self.__exit__()
            raise
        return self

    def program(self, role: str, program: Sequence[str] = BLOOMPEER_COMMAND) -> list[str]:
        """`program` run in a namespace ("public", or "home-h0" ...)."""
        return [*self.topology.exec_prefix(role), *program]

    def _start(self, name: str, role: str, args: Sequence[str]) -> PeerProcess:
        process = PeerProcess(name, args, self.log_dir, program=self.program(role))
        self.namespace_of[process.pid] = self.topology.ns(role)
        return process

    def add_server(self, start: int | None, end: int | None, extra_args: Sequence[str] = (), wait: bool = True,
                   name: str | None = None, model: str | Path | None = None, home: str | None = None
                   ) -> PeerProcess:
        """A server on the public host (a relay for the homes), or behind `home`'s router (relayed)."""
        blocks = [] if start is None else ["--blocks", f"{start}:{end}"]
        args = ["serve", "--model", str(model or self.model), *blocks, "--host-maddrs", ANY_ADDRESS,
                "--initial-peers", *self.initial_peers, *extra_args]
        server = self._start(name or f"server{len(self.servers)}", "public" if home is None else f"home-{home}", args)
        self.servers.append(server)
        if wait:
            server.wait_online(time.monotonic() + self.start_timeout_s)
        return server

    def scrape_context(self, pid: int) -> contextlib.AbstractContextManager:
        """Where a peer's metrics port (on 127.0.0.1 of its namespace) can be reached from."""
        return _network_namespace(self.namespace_of[pid])

    def __exit__(self, *exc_info) -> None:
        stop_in_parallel(self.servers)
        if self.bootstrap is not None:
            self.bootstrap.stop()
        self.topology.delete()


def relayed_servers(asked: int | None, servers: int) -> int:
    """How many servers to start behind NAT: as asked, or by default 4 where the machine allows it."""
    if asked == 0 or (asked is None and servers < 2):
        return 0
    if (reason := why_not_relayed()) is not None:
        if asked is not None:
            raise SystemExit(f"--relayed {asked}: {reason}")
        print(f"every server direct (no --relayed servers behind NAT): {reason}")
        return 0
    count = min(4, servers // 2) if asked is None else asked
    if not 0 < count <= min(MAX_RELAYED, servers):
        raise SystemExit(f"--relayed: between 0 and {min(MAX_RELAYED, servers)}")
    return count


def relay_figures(relayed: Sequence[PeerProcess]) -> tuple[int, list[float]]:
    """From what relayed servers printed: how many were reachable only through relays, and the seconds of
    each relay failover (a relay they held was lost -> announced through another)."""
    unreachable, failovers_s = 0, []
    for server in relayed:
        lines = list(server.stdout)
        unreachable += any(line.startswith("reachability: NOT directly") for line in lines)
        for line in lines:
            if line.startswith("relays:") and (took := re.search(r"announced again in ([0-9.]+) s", line)):
                failovers_s.append(float(took.group(1)))
    return unreachable, failovers_s
