"""A server behind NAT finds its relays on the DHT, and outlives the one it loses (root only).

    public:  a bootstrap peer started with --no-relay (it offers no relay), and four directly
             reachable servers of block 0:1, each a relay that says so in its records
    home-a:  a server of block 1:2 behind router-a; its only initial peer is the bootstrap
    home-b:  the clients, behind router-b

The server behind NAT reserves on two of the relays it finds in the records. A client generates
through it; mid-way the test SIGKILLs one of those two relays. The server reserves on another,
announces its new circuit address, and the client's generation ends with transformers' tokens.
Then the test SIGKILLs both relays the server holds, and a client that joins the swarm just then
must generate through it before a deadline 30 s after the second death. The records of the dead
relays stay on the DHT for up to three announce periods (90 s), so they keep offering them.
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
RELAYS = 4
FRESH_CLIENT_DEADLINE_S = 30.0  # issue 37's goal: from the last relay's death to the last token


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


def _go(go_file, give_up_at: float) -> None:
    """Let a client waiting with --join-after-go join, giving up at `give_up_at` (time.time())."""
    written = go_file.with_suffix(".tmp")
    written.write_text(repr(give_up_at))
    written.rename(go_file)  # whole at once: the client reads it as soon as it exists


def _failovers(server) -> list[str]:
    return [line for line in server.stdout if line.startswith("relays:")]


def _current_relays(server, relays) -> list:
    """The relays the server says it holds now: in its last `relays:` line, else its reachability line."""
    said = [line.split(" reserved on ", 1)[1] for line in _failovers(server)]
    line = said[-1] if said else _reachability(server)
    return [relay for relay in relays if relay.peer_id_str in line]


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
    spares = [relay for relay in relays if relay not in used]
    assert used[1].peer_id_str in line and any(spare.peer_id_str in line for spare in spares)  # survivor + new
    assert run["tokens"] == reference_tokens(checkpoint, PROMPT, NEW_TOKENS)
    assert result["replays"] >= 1  # its session with the server behind NAT ended with the old daemon
    via = run["connections"].get(behind_nat.peer_id_str, [])
    assert via and all("/p2p-circuit" in m and victim.peer_id_str not in m for m in via), via
    assert re.search(r"announced again in \d+\.\d\d s", line)


def test_a_fresh_client_reaches_the_server_after_all_its_relays_die(swarm, checkpoint, tmp_path):
    """Both relays the server holds die at once; a client that joins the swarm then, behind another
    router, must generate through the server within FRESH_CLIENT_DEADLINE_S of the second death
    (its waits for missing blocks and for recovery end then, and its client is shut down then).
    Its process starts before, so that its imports on loaded cores are not what is timed."""
    topology, peers, bootstrap_maddr, relays, behind_nat = swarm
    held = _current_relays(behind_nat, relays)
    assert len(held) == 2 and any(relay.process.poll() is None for relay in relays if relay not in held)
    go_file = tmp_path / "go"
    client = peers.start("fresh-client", "home-b", str(checkpoint), bootstrap_maddr, "--new-tokens", str(NEW_TOKENS),
                         "--join-after-go", "--go-file", str(go_file), program=PAUSED_CLIENT)
    client.wait_for_line("ready", deadline(180))  # imported: it has not joined the swarm yet
    failovers_before = _failovers(behind_nat)
    for relay in held:
        kill(relay)
    killed_at = time.time()
    _go(go_file, give_up_at=killed_at + FRESH_CLIENT_DEADLINE_S)
    result = client_result(client)
    print("\n".join(_failovers(behind_nat)[len(failovers_before):]))
    print(f"both relays killed -> fresh client's last token: {result['finished_at'] - killed_at:.1f} s"
          f"{' (gave up: ' + result['error'] + ')' if 'error' in result else ''}")
    assert "error" not in result, result["error"]
    run = result["runs"][0]
    assert run["tokens"] == reference_tokens(checkpoint, PROMPT, NEW_TOKENS)
    via = run["connections"].get(behind_nat.peer_id_str, [])
    assert via and all(not any(dead.peer_id_str in m for dead in held) for m in via), via
