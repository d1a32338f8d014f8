"""A swarm shared by the tests that only read from it: a bootstrap peer and two servers as real
processes on 127.0.0.1, over the tiny checkpoint; and a client model joined to it."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from bloompeer import ClientConfig, DistributedBloomForCausalLM, NetworkConfig
from bloompeer.peer.local_swarm import LocalSwarm

MARKER_ENV = "BLOOMPEER_TEST_MARKER"


@pytest.fixture(scope="session")
def swarm(tiny_checkpoint, tmp_path_factory):
    with LocalSwarm(tiny_checkpoint, [(0, 2), (2, 4)], log_dir=tmp_path_factory.mktemp("swarm-logs")) as swarm:
        yield swarm


@pytest.fixture(scope="session", params=[False, True], ids=["no-push", "push"])
def model(request, swarm, tiny_checkpoint):
    """A client of the shared swarm, without and with server-to-server push."""
    config = ClientConfig(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True), push=request.param)
    with DistributedBloomForCausalLM.from_pretrained(tiny_checkpoint, client_config=config) as model:
        yield model


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs of live processes whose environment has name=value (children inherit it, p2pd included)."""
    needle = f"{name}={value}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                status = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if status != "Z":
                    pids.append(int(proc.name))
        except OSError:
            continue
    return pids


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
    for server in started:
        server.stop()


def swarm_client(swarm, model_path, tuning_mode=None, pre_seq_len=0, **config) -> DistributedBloomForCausalLM:
    """A client of `model_path` on the shared swarm, with short timeouts so faults show quickly."""
    network = NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True)
    settings = dict(request_timeout_s=3.0, swarm_refresh_period_s=1.0, poll_period_s=0.5) | config
    return DistributedBloomForCausalLM.from_pretrained(model_path, client_config=ClientConfig(network, **settings),
                                                       tuning_mode=tuning_mode, pre_seq_len=pre_seq_len)
