"""Peers behind NAT, in a real (if small) network: Linux namespaces, masquerading routers (root only).

    public:  bootstrap peer and server 1 (blocks 0:1), directly reachable
    home-a:  server 2 (blocks 1:2) behind router-a: nobody outside can dial it. It names server 1 as
             its initial peer, so server 1 (a plain directly reachable server) is its relay
    home-b:  the client, behind router-b; it knows only the bootstrap peer

The client generates through both servers with a prompt whose activations alone make more than
4 MiB into the home-a server, and the tokens must equal transformers' on one machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoTokenizer, BloomConfig, BloomForCausalLM

from bloompeer.peer.cli.default_model import write_byte_tokenizer
from bloompeer.peer.cli.local_swarm import PeerProcess

from .netns import NatTopology, TopologyError

HIDDEN = 1024  # 4 KiB of float32 activations per token
PROMPT_TOKENS = 1200  # the byte-level tokenizer makes one token per byte of this ASCII prompt
NEW_TOKENS = 8
BOOTSTRAP_PORT = 31337
BLOOMPEER = [sys.executable, "-m", "bloompeer"]


@pytest.fixture(scope="module")
def topology():
    if os.geteuid() != 0:
        pytest.fail("the NAT test builds network namespaces and needs root (CI runs as root)")
    try:
        with NatTopology() as network:
            yield network
    except TopologyError as exc:
        pytest.fail(f"the kernel or tools refused the test network: {exc}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wide-bloom")
    vocab = write_byte_tokenizer(directory)
    torch.manual_seed(0)
    config = BloomConfig(vocab_size=vocab, hidden_size=HIDDEN, n_layer=2, n_head=16, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    BloomForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def swarm(topology, checkpoint, tmp_path_factory):
    """Bootstrap and server 1 in the public namespace, server 2 in home-a; stopped after the module.
    Yields the bootstrap's multiaddr, server 1's (server 2's relay) and the two server processes."""
    logs = tmp_path_factory.mktemp("nat-logs")
    processes = []

    def start(name, role, *args):
        process = PeerProcess(name, args, logs, program=[*topology.exec_prefix(role), *BLOOMPEER])
        processes.append(process)
        return process

    try:
        bootstrap = start("bootstrap", "public", "dht", "--host-maddrs",
                          f"/ip4/0.0.0.0/tcp/{BOOTSTRAP_PORT}")
        deadline = _deadline()
        bootstrap_maddr = bootstrap.wait_for_line(f"/ip4/{topology.PUBLIC_IP}/", deadline)
        serve = ["serve", "--model", str(checkpoint), "--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--initial-peers"]
        direct = start("server-direct", "public", *serve, bootstrap_maddr, "--blocks", "0:1")
        relay_maddr = direct.wait_for_line(f"/ip4/{topology.PUBLIC_IP}/", deadline)
        behind_nat = start("server-home-a", "home-a", *serve, relay_maddr, "--blocks", "1:2")
        for server in (direct, behind_nat):
            server.wait_online(deadline)
        yield bootstrap_maddr, relay_maddr, direct, behind_nat
    finally:
        for process in reversed(processes):
            process.stop()


def _deadline(seconds: float = 120.0) -> float:
    return time.monotonic() + seconds


def _reachability(server: PeerProcess) -> str:
    return next(line for line in server.stdout if line.startswith("reachability:"))


def test_a_client_behind_nat_generates_through_a_server_behind_nat(topology, checkpoint, swarm):
    bootstrap_maddr, _, direct, behind_nat = swarm
    prompt = ("The quick brown fox jumps over the lazy dog. " * 40)[:PROMPT_TOKENS]
    assert PROMPT_TOKENS * HIDDEN * 4 > 4 * 2**20  # what the home-a server receives for the prompt alone
    result = subprocess.run(
        [*topology.exec_prefix("home-b"), *BLOOMPEER, "generate", prompt, "--model", str(checkpoint),
         "--max-new-tokens", str(NEW_TOKENS), "--initial-peers", bootstrap_maddr],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] == PROMPT_TOKENS
    reference = BloomForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert result.stdout.rstrip("\n") == prompt + tokenizer.decode(expected[0, PROMPT_TOKENS:])
    routes = [line for line in result.stderr.splitlines() if "Route for blocks 0:2" in line]
    assert routes and behind_nat.peer_id_str[-8:] in routes[0] and direct.peer_id_str[-8:] in routes[0]


def test_the_server_behind_nat_is_reached_through_the_relay(topology, swarm):
    _, relay_maddr, direct, behind_nat = swarm
    print(_reachability(direct), _reachability(behind_nat), sep="\n")  # shown with pytest -s
    assert _reachability(direct).startswith("reachability: directly reachable at /ip4/10.99.0.10/tcp/")
    line = _reachability(behind_nat)
    assert line.startswith("reachability: NOT directly reachable") and relay_maddr in line
    announced = [m for m in behind_nat.stdout if m.startswith("/")]
    assert announced and all("/p2p-circuit" in m for m in announced)  # it is announced only through the relay
    assert not any("192.168.1.2" in m for m in announced)


def test_a_direct_dial_to_the_server_behind_nat_fails(topology, swarm):
    """From the public side, neither its own address nor its router's address accepts a connection."""
    *_, behind_nat = swarm
    port = re.search(r"/ip4/192\.168\.1\.2/tcp/(\d+)", _reachability(behind_nat)).group(1)
    for host in ("192.168.1.2", "10.99.0.2"):
        probe = ("import socket, sys\ns = socket.socket(); s.settimeout(3)\n"
                 "try:\n    s.connect((sys.argv[1], int(sys.argv[2]))); print('connected')\n"
                 "except OSError as e:\n    print('refused', e)\n")
        out = subprocess.run([*topology.exec_prefix("public"), sys.executable, "-c", probe, host, str(port)],
                             capture_output=True, text=True, timeout=30).stdout
        assert out.startswith("refused"), (host, out)
