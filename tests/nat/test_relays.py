"""A server behind NAT finds its relays on the DHT, and outlives the one it loses (root only).

    public:  a bootstrap peer started with --no-relay (it offers no relay), and three directly
             reachable servers of block 0:1, each a relay that says so in its records
    home-a:  a server of block 1:2 behind router-a; its only initial peer is the bootstrap
    home-b:  the client, behind router-b

The server behind NAT reserves on two of the relays it finds in the records. The client generates
through it; mid-way the test SIGKILLs one of those two relays. The server reserves on the third,
announces its new circuit address, and the client's generation ends with transformers' tokens.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from .swarm import (
    PAUSED_CLIENT, NamespacedPeers, build_topology, client_result, deadline, kill, reference_tokens, resume,
    write_checkpoint,
)

PROMPT = torch.tensor([[1, 30, 31, 32, 33]])
NEW_TOKENS = 24
PAUSE_AT = 6
RELAYS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bloom"), hidden=64)


@pytest.fixture(scope="module")
def swarm(checkpoint, tmp_path_factory):
    topology = build_topology()
    peers = NamespacedPeers(topology, tmp_path_factory.mktemp("relay-logs"))
    try:
        bootstrap = peers.start("bootstrap", "public", "dht", "--no-relay", "--host-maddrs", "/ip4/0.0.0.0/tcp/31337")
        bootstrap_maddr = bootstrap.wait_for_line(f"/ip4/{topology.PUBLIC_IP}/", deadline())
        serve = ["serve", "--model", str(checkpoint), "--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--throughput", "100",
                 "--initial-peers", bootstrap_maddr]
        relays = [peers.start(f"relay{index}", "public", *serve, "--blocks", "0:1") for index in range(RELAYS)]
        for relay in relays:
            relay.wait_online(deadline())
        behind_nat = peers.start("server-home-a", "home-a", *serve, "--blocks", "1:2")
        behind_nat.wait_online(deadline())
        yield topology, peers, bootstrap_maddr, relays, behind_nat
    finally:
        peers.stop()
        topology.delete()


def _reachability(server) -> str:
    return next(line for line in server.stdout if line.startswith("reachability:"))


def test_the_server_behind_nat_reserves_on_two_relays_found_on_the_dht(swarm):
    _, _, bootstrap_maddr, relays, behind_nat = swarm
    line = _reachability(behind_nat)
    print(line)  # shown with pytest -s
    assert line.startswith("reachability: NOT directly reachable") and "relays found on the DHT" in line
    used = [relay for relay in relays if relay.peer_id_str in line]
    assert len(used) == 2 and bootstrap_maddr not in line


def test_a_lost_relay_is_replaced_while_a_client_generates(swarm, checkpoint, tmp_path):
    topology, peers, bootstrap_maddr, relays, behind_nat = swarm
    go_file = tmp_path / "go"
    client = peers.start("client", "home-b", str(checkpoint), bootstrap_maddr, "--new-tokens", str(NEW_TOKENS),
                         "--pause-at", str(PAUSE_AT), "--go-file", str(go_file), program=PAUSED_CLIENT)
    route = client.wait_for_line("paused", deadline(180))
    assert behind_nat.peer_id_str in route
    used = [relay for relay in relays if relay.peer_id_str in _reachability(behind_nat)]
    victim = used[0]
    killed_at = time.monotonic()
    kill(victim)
    line = behind_nat.wait_for_line("relays:", deadline(30))
    reachable_again_s = time.monotonic() - killed_at
    resume(go_file)
    result = client_result(client)
    run = result["runs"][0]
    print(f"{line}\nrelay killed -> announced through another: {reachable_again_s:.2f} s; "
          f"client replays: {result['replays']}")
    assert victim.peer_id_str[-8:] in line
    spare = next(relay for relay in relays if relay not in used)
    assert spare.peer_id_str in line and used[1].peer_id_str in line  # the survivor, and the one it had not used
    assert run["tokens"] == reference_tokens(checkpoint, PROMPT, NEW_TOKENS)
    assert result["replays"] >= 1  # its session with the server behind NAT ended with the old daemon
    via = run["connections"].get(behind_nat.peer_id_str, [])
    assert via and all("/p2p-circuit" in m and victim.peer_id_str not in m for m in via), via
    assert re.search(r"announced again in \d+\.\d\d s", line)
