"""Hole punching: a relayed connection between peers behind NAT becomes direct (root only).

    public:  four `bloompeer dht` peers (boot, p1, p2, p3): relays, and observers of the others'
             addresses
    home-a:  a server of block 0:1 behind router-a;  home-b: a server of block 1:2 behind router-b
    home-c:  the client, behind router-c

The routers masquerade and drop unsolicited packets; nobody forwards a port. The client generates
twice. Its first sessions open through relays (nothing else reaches a home); while they run,
libp2p's DCUtR (hole punching, on in hivemind's daemon with AutoNAT) has each server and the
client dial each other at the same moment, which the routers take for replies. The second run's
sessions then open on the direct connections.

libp2p starts hole punching only once a peer has a *public* address observed by several peers
(go-libp2p's identify and holepunch services, with go-multiaddr's manet.IsPublicAddr). The test
runs twice over: the internet on 3fff:99::/64 (IPv6 documentation range 3fff::/20, RFC 9637, which
go-multiaddr 0.12 counts as public) and on 203.0.113.0/24 (IPv4 TEST-NET-3, in go-multiaddr's
unroutable list in net/private.go): there the observed addresses never count as public, hole
punching never starts, and the connections stay relayed. On real public addresses it is the first
case.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from .swarm import PAUSED_CLIENT, NamespacedPeers, build_topology, client_result, deadline, reference_tokens, \
    write_checkpoint

PROMPT = torch.tensor([[1, 30, 31, 32, 33]])
NEW_TOKENS = 16
PUBLIC = ("boot", "p1", "p2", "p3")
FAMILIES = {"ip6": ("::", "3fff:99:"), "ip4": ("0.0.0.0", "203.0.113")}
GO_LOGS = {"GOLOG_LOG_LEVEL": "error,p2p-holepunch=debug,autorelay=debug"}  # the daemon's hole punching steps, in -v logs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bloom"), hidden=64)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return reference_tokens(checkpoint, PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module", params=list(FAMILIES))
def generated(request, checkpoint, tmp_path_factory):
    """(family, topology, the two servers, the client's result) for a swarm on one address family."""
    family = request.param
    anywhere, prefix = FAMILIES[family]
    topology = build_topology(public_hosts=PUBLIC, homes=("a", "b", "c"),
                              **({"wan6": prefix} if family == "ip6" else {"wan4": prefix}))
    peers = NamespacedPeers(topology, tmp_path_factory.mktemp(f"holepunch-{family}"))
    listen = ["--host-maddrs", f"/{family}/{anywhere}/tcp/0"]
    ip = topology.ip6 if family == "ip6" else topology.ip4
    try:
        boot = peers.start("boot", "boot", "dht", *listen)
        boot_maddr = boot.wait_for_line(f"/{family}/{ip('boot')}/", deadline())
        others = [peers.start(host, host, "dht", *listen, "--initial-peers", boot_maddr) for host in PUBLIC[1:]]
        public = [boot_maddr, *(peer.wait_for_line(f"/{family}/{ip(peer.name)}/", deadline()) for peer in others)]
        serve = ["-v", "serve", "--model", str(checkpoint), *listen, "--throughput", "100", "--initial-peers", *public]
        servers = [peers.start(f"server-{home}", f"home-{home}", *serve, "--blocks", blocks, env=GO_LOGS)
                   for home, blocks in (("a", "0:1"), ("b", "1:2"))]
        for server in servers:
            server.wait_online(deadline())
        client = peers.start("client", "home-c", str(checkpoint), *public, "--runs", "2", "--new-tokens",
                             str(NEW_TOKENS), *listen, program=PAUSED_CLIENT)
        yield family, topology, servers, client_result(client)
    finally:
        peers.stop()
        topology.delete()


def _paths(result_run: dict, server) -> list[str]:
    return result_run["connections"].get(server.peer_id_str, [])


def test_the_connection_becomes_direct_where_libp2p_sees_public_addresses(generated, expected):
    family, topology, servers, result = generated
    first, second = result["runs"]
    assert first["tokens"] == expected and second["tokens"] == expected
    for server in servers:
        router = topology.ip6(f"router-{server.name[-1]}") if family == "ip6" else None
        paths = _paths(second, server)
        print(f"{family} {server.name}: {paths}")  # shown with pytest -s
        log = server.log_path.read_text(errors="replace")
        if family == "ip6":  # relayed first (nothing else reaches a home), then punched through the router
            assert any("/p2p-circuit" in path for path in _paths(first, server)) or "hole punch successful" in log
            assert f"/ip6/{router}/tcp/" in " ".join(paths), paths
            assert "hole punch successful" in log
        else:  # the observed 203.0.113.x addresses are not public to libp2p: no hole punching at all
            assert paths and all("/p2p-circuit" in path for path in paths), paths
            assert "waiting until we have at least one public address" in log
            assert "Starting holepunch protocol" not in log
    steps = [statistics.median(run["step_s"]) * 1000 for run in (first, second)]
    print(f"{family}: step median {steps[0]:.2f} ms in the first run (relayed sessions), "
          f"{steps[1]:.2f} ms in the second ({'direct' if family == 'ip6' else 'relayed'})")
