"""Shared fixtures: tiny random BLOOM checkpoints written to temp dirs (tests never download), and one
swarm for the whole run (a bootstrap peer and two servers as real processes on 127.0.0.1) that every
test directory shares, with servers of their own started on it where a test needs them."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import BloomForCausalLM

from bloompeer.p2p import NetworkConfig, PeerNode
from bloompeer.peer.cli.default_model import write_random_checkpoint
from bloompeer.peer.cli.local_swarm import LocalSwarm, stop_in_parallel

TINY_BLOCKS = 4


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A 4-block BLOOM (hidden 64) with a byte-level tokenizer, sharded over many small files."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-bloom"), num_blocks=TINY_BLOCKS, hidden_size=64,
                                   num_heads=4, seed=1, max_shard_size="40KB")


@pytest.fixture(scope="session")
def reference_model(tiny_checkpoint) -> BloomForCausalLM:
    """transformers' own BLOOM on the same weights: the numeric reference."""
    return BloomForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def swarm(tiny_checkpoint, tmp_path_factory):
    with LocalSwarm(tiny_checkpoint, [(0, 2), (2, 4)], log_dir=tmp_path_factory.mktemp("swarm-logs")) as swarm:
        yield swarm


@pytest_asyncio.fixture
async def node(swarm):
    """A client-mode network peer in the shared swarm, for tests that speak the wire protocol (tests/wire.py)."""
    node = await PeerNode.create(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True))
    yield node
    await node.shutdown()


@pytest.fixture
def fresh_model(tiny_checkpoint, tmp_path):
    """A copy of the tiny checkpoint under a name of its own, so its servers serve no other test."""
    path = tmp_path / f"model-{uuid.uuid4().hex[:8]}"
    shutil.copytree(tiny_checkpoint, path)
    return path


@pytest.fixture
def start_servers(swarm, fresh_model):
    """start_servers([(0, 4), (0, 2)], *extra_args, program=None) -> PeerProcesses of `fresh_model`,
    started in parallel on the shared bootstrap peer; all stopped after the test."""
    started = []

    def start(spans, *extra_args, program=None, model=None):
        servers = [swarm.add_server(a, b, model=model or fresh_model, wait=False, extra_args=extra_args,
                                    name=f"{fresh_model.name}-{len(started) + i}", program=program)
                   for i, (a, b) in enumerate(spans)]
        started.extend(servers)
        deadline = time.monotonic() + 120
        for server in servers:
            server.wait_online(deadline)
        return servers

    yield start
    stop_in_parallel(started)
