"""A swarm shared by the tests that only read from it: a bootstrap peer and two servers as real
processes on 127.0.0.1, over the tiny checkpoint; and a client model joined to it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bloompeer import DistributedBloomForCausalLM
from bloompeer.peer.local_swarm import LocalSwarm

MARKER_ENV = "BLOOMPEER_TEST_MARKER"


@pytest.fixture(scope="session")
def swarm(tiny_checkpoint, tmp_path_factory):
    with LocalSwarm(tiny_checkpoint, [(0, 2), (2, 4)], log_dir=tmp_path_factory.mktemp("swarm-logs")) as swarm:
        yield swarm


@pytest.fixture(scope="session")
def model(swarm, tiny_checkpoint):
    with DistributedBloomForCausalLM.from_pretrained(tiny_checkpoint, initial_peers=swarm.initial_peers) as model:
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
