"""A client that generates greedily through the swarm, pausing once mid-way for the test to act.

Run inside a namespace by the NAT tests:
    python paused_client.py CHECKPOINT BOOTSTRAP_MADDR NEW_TOKENS PAUSE_AT GO_FILE [HOST_MADDR ...]
It prints `paused <route>` at its PAUSE_AT-th token and waits until GO_FILE exists (the test kills
a relay meanwhile; PAUSE_AT 0: no pause), then prints one JSON line: the new tokens, the sessions it replayed, how long
each token took, and the addresses its daemon is connected to each server at.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from bloompeer import ClientConfig, DistributedBloomForCausalLM, NetworkConfig

PROMPT = torch.tensor([[1, 30, 31, 32, 33]])


class _Replays(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("Replaying")


class _PauseAndTime(LogitsProcessor):
    """Called once per new token, in generate's loop: times the tokens, and pauses at one."""

    def __init__(self, model, pause_at: int, go_file: Path):
        self.model, self.pause_at, self.go_file = model, pause_at, go_file
        self.calls, self.times = 0, [time.monotonic()]

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.pause_at:
            route = " ".join(f"{s.peer_id_str}[{s.start}:{s.end}]" for s in self.model.active_session.route)
            print(f"paused {route}", flush=True)
            while not self.go_file.exists():
                time.sleep(0.05)
            self.times.append(time.monotonic())  # the pause is no token's time
        self.times.append(time.monotonic())
        return scores


async def _connections(p2p) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for info in await p2p.list_peers():
        found.setdefault(info.peer_id.to_base58(), []).extend(str(addr) for addr in info.addrs)
    return found


def main() -> None:
    checkpoint, bootstrap, new_tokens, pause_at, go_file, *host_maddrs = sys.argv[1:]
    replays = _Replays()
    logging.getLogger("bloompeer").addHandler(replays)
    logging.getLogger("bloompeer").setLevel(logging.INFO)
    network = NetworkConfig(initial_peers=(bootstrap,), client_mode=True,
                            **({"host_maddrs": tuple(host_maddrs)} if host_maddrs else {}))
    config = ClientConfig(network, request_timeout_s=3.0, swarm_refresh_period_s=1.0, poll_period_s=0.5)
    model = DistributedBloomForCausalLM.from_pretrained(checkpoint, client_config=config)
    timer = _PauseAndTime(model, int(pause_at), Path(go_file))
    with torch.inference_mode():
        tokens = model.generate(PROMPT, max_new_tokens=int(new_tokens), min_new_tokens=int(new_tokens),
                                do_sample=False, logits_processor=LogitsProcessorList([timer]))
    client = model.remote.client
    connections = client.runtime.run(_connections(client.node.p2p))
    steps = [later - earlier for earlier, later in zip(timer.times, timer.times[1:])]
    print(json.dumps({"tokens": tokens[0, PROMPT.shape[1]:].tolist(), "replays": replays.count,
                      "step_s": steps, "connections": connections}), flush=True)


if __name__ == "__main__":
    main()
