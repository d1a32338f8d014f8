"""A client model joined to the shared swarm (tests/conftest.py), and helpers for swarm tests."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
from transformers import LogitsProcessor

from bloompeer import ClientConfig, DistributedBloomForCausalLM, NetworkConfig

MARKER_ENV = "BLOOMPEER_TEST_MARKER"


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


def swarm_client(swarm, model_path, tuning_mode=None, pre_seq_len=0, **config) -> DistributedBloomForCausalLM:
    """A client of `model_path` on the shared swarm, with short timeouts so faults show quickly."""
    network = NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True)
    settings = dict(request_timeout_s=3.0, swarm_refresh_period_s=1.0, poll_period_s=0.5) | config
    return DistributedBloomForCausalLM.from_pretrained(model_path, client_config=ClientConfig(network, **settings),
                                                       tuning_mode=tuning_mode, pre_seq_len=pre_seq_len)


def seen_servers(model) -> set[str]:
    return {record.peer_id for records in model.client.swarm.servers.values() for record in records}


def wait_until_seen(model, spans: dict[str, range], timeout_s: float = 30.0) -> None:
    """The choice is tested, so every candidate must be in the client's view for each of its blocks
    (a DHT read can come back partial: one block's lookup may miss a server that another's found,
    or miss a slowed server whose DHT node is stopped), and its round trip measured (a ping can fail
    on a loaded machine, and a server that did not answer is routed around as if it were far away)."""
    deadline = time.monotonic() + timeout_s
    while True:
        model.client.runtime.run(model.client.swarm.refresh())
        servers = model.client.swarm.servers
        seen = {peer for peer, blocks in spans.items()
                if all(peer in {record.peer_id for record in servers.get(block, [])} for block in blocks)}
        rtts_s = model.client.swarm.rtts_s  # a refresh pings again a server whose last ping failed
        if seen == set(spans) and all(rtts_s.get(peer, math.inf) < math.inf for peer in spans):
            return
        assert time.monotonic() < deadline, f"the client saw all the blocks of only {seen} of {set(spans)}"


class AtCall(LogitsProcessor):
    """Calls `action` once, at the `at`-th call: inside generate's loop, while a token is chosen (a
    speculative verify pass calls it once per checked position)."""

    def __init__(self, at: int, action):
        self.at, self.action, self.count = at, action, 0

    def __call__(self, input_ids, scores):
        self.count += 1
        if self.count == self.at:
            self.action()
        return scores


@pytest.fixture
def rewinds(monkeypatch) -> list[int]:
    """Every position a session's cache was rolled back to during the test."""
    from bloompeer.peer.client.inference_session import InferenceSession

    seen, rewind = [], InferenceSession.rewind

    def recording(session, position):
        if position < session.position:
            seen.append(position)
        return rewind(session, position)

    monkeypatch.setattr(InferenceSession, "rewind", recording)
    return seen
