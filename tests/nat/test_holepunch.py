"""Hole punching: a relayed connection between peers behind NAT becomes direct (root only).

    public:  four `bloompeer dht` peers (boot, p1, p2, p3): relays (the servers' initial peers),
             and observers of the others' addresses. p1..p3 run with --no-relay, which saves their
             start the relay self-check; their daemons still relay, with libp2p's default limits
             (128 KiB and 2 min per connection), enough for this tiny model
    home-a:  a server of block 0:1 behind router-a;  home-b: a server of block 1:2 behind router-b
    home-c:  the clients, behind router-c

The routers masquerade and drop unsolicited packets; nobody forwards a port. A client generates
twice. Its first sessions open through relays (nothing else reaches a home); meanwhile libp2p's
DCUtR (hole punching, on in hivemind's daemon with AutoNAT) has each server and the client dial
each other at the same moment, which each router takes for the reply to its own side's dial. The
second run's sessions open on the direct connections. The client first waits until its daemon
serves hole punching: libp2p tries once per relayed connection, and a client that reaches a server
before then keeps that connection relayed (seen here when it came a few seconds after the start).

libp2p punches only between peers that each have a *public* address observed by several peers
(go-libp2p's identify and holepunch services, with go-multiaddr's manet.IsPublicAddr):
  - on 3fff:99::/64 (IPv6 documentation range 3fff::/20, RFC 9637; go-multiaddr 0.12 counts it
    as public) it works, for a client that listens on a non-loopback address: its dials then
    leave from its listening port, the port its router maps and peers observe. A client on the
    default 127.0.0.1 has no such address and stays relayed;
  - on 203.0.113.0/24 (IPv4 TEST-NET-3, in go-multiaddr's unroutable list, net/private.go) no
    address there counts as public: no hole punching starts, and the servers behind NAT have no
    address at all (go-libp2p's autorelay keeps only private addresses of its own and circuits
    through relays with public addresses), so nobody can reach them. On real public IPv4
    addresses it is the first case.
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
GO_LOGS = {"GOLOG_LOG_LEVEL": "error,p2p-holepunch=debug"}  # the daemon's hole punching steps, in -v logs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bloom"), hidden=64)


def _swarm(family: str, checkpoint, log_dir, homes=("a", "b")):
    """A generator: (topology, peers, the public peers' maddrs, the servers) on one address family:
    a server of block 0:1 in home-a, and of block 1:2 in home-b if `homes` has it."""
    anywhere, layout = ("::", {"wan6": "3fff:99:"}) if family == "ip6" else ("0.0.0.0", {"wan4": "203.0.113"})
    topology = build_topology(public_hosts=PUBLIC, homes=(*homes, "c"), **layout)
    peers = NamespacedPeers(topology, log_dir)
    listen = ["--host-maddrs", f"/{family}/{anywhere}/tcp/0"]
    ip = topology.ip6 if family == "ip6" else topology.ip4
    try:
        boot = peers.start("boot", "boot", "dht", *listen)
        boot_maddr = boot.wait_for_line(f"/{family}/{ip('boot')}/", deadline())
        others = [peers.start(host, host, "dht", "--no-relay", *listen, "--initial-peers", boot_maddr)
                  for host in PUBLIC[1:]]
        public = [boot_maddr, *(peer.wait_for_line(f"/{family}/{ip(peer.name)}/", deadline()) for peer in others)]
        serve = ["-v", "serve", "--model", str(checkpoint), *listen, "--throughput", "100", "--initial-peers", *public]
        servers = [peers.start(f"server-{home}", f"home-{home}", *serve, "--blocks", blocks, env=GO_LOGS)
                   for home, blocks in (("a", "0:1"), ("b", "1:2")) if home in homes]
        for server in servers:
            server.wait_online(deadline())
        yield topology, peers, public, servers
    finally:
        peers.stop()
        topology.delete()


@pytest.fixture(scope="module")
def ipv6(checkpoint, tmp_path_factory):
    """The IPv6 swarm, and the results of two clients that generated twice each, one after the
    other: one listening on [::] (port 0), one on the default 127.0.0.1."""
    for topology, peers, public, servers in _swarm("ip6", checkpoint, tmp_path_factory.mktemp("holepunch-ip6")):
        common = [str(checkpoint), *public, "--runs", "2", "--new-tokens", str(NEW_TOKENS)]
        listening = ["--host-maddrs", "/ip6/::/tcp/0", "--wait-holepunch"]
        results = {"listening": client_result(peers.start("client", "home-c", *common, *listening,
                                                          program=PAUSED_CLIENT, env=GO_LOGS)),
                   "loopback": client_result(peers.start("client-loopback", "home-c", *common,
                                                         program=PAUSED_CLIENT))}
        yield topology, servers, results


@pytest.fixture(scope="module")
def ipv4(checkpoint, tmp_path_factory):
    for _, _, _, servers in _swarm("ip4", checkpoint, tmp_path_factory.mktemp("holepunch-ip4"), homes=("a",)):
        yield servers


def _paths(run: dict, server) -> list[str]:
    return run["connections"].get(server.peer_id_str, [])


def _median_ms(run: dict) -> float:
    """A decode step's median (the first token's time, which includes the prompt, left out)."""
    return statistics.median(run["step_s"][1:]) * 1000


def test_on_ipv6_the_relayed_connection_becomes_direct(ipv6, checkpoint):
    topology, servers, results = ipv6
    first, second = results["listening"]["runs"]
    expected = reference_tokens(checkpoint, PROMPT, NEW_TOKENS)
    assert first["tokens"] == expected and second["tokens"] == expected
    for server in servers:
        router = topology.ip6(f"router-{server.name[-1]}")
        print(f"{server.name}: the client's connections after the runs: {_paths(second, server)}")  # pytest -s
        assert any(path.startswith(f"/ip6/{router}/tcp/") for path in _paths(second, server))  # through its router
        assert "hole punch successful" in server.log_path.read_text(errors="replace")
    print(f"listening client, decode step median: {_median_ms(first):.2f} ms in the first run (sessions opened "
          f"relayed), {_median_ms(second):.2f} ms in the second (direct)")


def test_a_client_listening_on_loopback_only_stays_relayed(ipv6, checkpoint):
    _, servers, results = ipv6
    runs = results["loopback"]["runs"]
    assert all(run["tokens"] == reference_tokens(checkpoint, PROMPT, NEW_TOKENS) for run in runs)
    assert not any("/ip6/3fff:99::4/" in maddr for maddr in results["loopback"]["own_maddrs"])  # no public address
    for server in servers:
        assert _paths(runs[1], server) and all("/p2p-circuit" in path for path in _paths(runs[1], server))
    print(f"loopback client, decode step median: {_median_ms(runs[0]):.2f} ms, then {_median_ms(runs[1]):.2f} ms "
          f"(both relayed)")


def test_on_ipv4_documentation_addresses_libp2p_does_not_punch_nor_announce(ipv4):
    for server in ipv4:
        log = server.log_path.read_text(errors="replace")
        assert "waiting until we have at least one public address" in log
        assert "Starting holepunch protocol" not in log  # its observed 203.0.113.x address never counts
        assert not [line for line in server.stdout if line.startswith("/")]  # and it has no address to give
