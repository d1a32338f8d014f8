"""Servers started with --num-blocks move where the swarm needs them: every server of a range is
SIGKILLed while a client generates (their records still say online, for 90 s), a spare server moves
there, and the client's tokens are still exactly transformers'.

Real CLI servers on 127.0.0.1 (the default rebalancing period), on the session's bootstrap peer.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import torch

from .conftest import AtCall
from .conftest import swarm_client as _client
from .test_server_metrics import scrape, value

PROMPT = torch.tensor([[1, 40, 41, 42, 43]])
NEW_TOKENS = 24
RECOVERY_TIMEOUT_S = 150.0  # the client's own, generous: re-coverage is reported, never timed by an assert


def _lines(server, prefix: str) -> list[str]:
    return [line for line in list(server.stdout) if line.startswith(prefix)]


class _Watch(threading.Thread):
    """Notes when each spare first prints a second "online" line (serving the blocks it moved to)."""

    def __init__(self, spares):
        super().__init__(daemon=True)
        self.spares, self.online_at = spares, {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            for spare in self.spares:
                if spare.peer_id_str not in self.online_at and len(_lines(spare, "online")) > 1:
                    self.online_at[spare.peer_id_str] = time.monotonic()


def test_a_killed_range_is_served_again_by_a_spare_and_the_client_loses_no_token(
        swarm, fresh_model, start_servers, reference_model):
    with torch.inference_mode():
        expected = reference_model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                            do_sample=False)
    doomed = start_servers([(0, 2), (2, 4), (2, 4)])[1:]
    # with 0:2 once and 2:4 twice, both spares choose 0:2; they stay there while nothing changes
    spares = start_servers([(None, None), (None, None)], "--num-blocks", "2", "--metrics-port", "0")
    assert [spare.blocks for spare in spares] == [(0, 2), (0, 2)]
    killed_at = []

    def kill_the_range():
        for server in doomed:
            server.signal(signal.SIGKILL)
        killed_at.append(time.monotonic())

    watch = _Watch(spares)
    watch.start()
    try:
        with _client(swarm, fresh_model, recovery_timeout_s=RECOVERY_TIMEOUT_S) as model, torch.inference_mode():
            tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                    logits_processor=[AtCall(4, kill_the_range)])
    finally:
        watch.stop.set()
        watch.join()
    assert tokens.tolist() == expected.tolist()
    moved = [spare for spare in spares if _lines(spare, "moving")]
    assert moved and all(_lines(spare, "moving")[0].split(" blocks ")[1].startswith("2:4") for spare in moved), (
        [spare.stdout for spare in spares])
    first = min(watch.online_at.values())
    print(f"\nblocks 2:4 served again {first - killed_at[0]:.1f} s after both of their servers were SIGKILLed "
          f"({len(moved)} spare(s) moved)")

    mover = moved[0]
    # the mover's old blocks say offline (they expire by themselves), its new ones online
    expected = {0: ("offline", 0, 2), 1: ("offline", 0, 2), 2: ("online", 2, 4), 3: ("online", 2, 4)}

    def movers(records):
        return {index: records.get(index, {}).get(mover.peer_id_str) for index in expected}

    assert movers(_status_records_when(fresh_model, swarm, lambda records: movers(records) == expected)) == expected
    metrics_url = _lines(mover, "metrics: ")[0].split(": ", 1)[1]
    assert value(scrape(metrics_url), "bloompeer_server_moves_total") == 1.0


def _status_records_when(model, swarm, settled, timeout_s: float = 60.0) -> dict:
    """_status_records until `settled` holds of them, or for timeout_s (then the last ones): a DHT
    lookup may miss for a while a record that was stored on other peers than those it asked."""
    deadline = time.monotonic() + timeout_s
    while not settled(records := _status_records(model, swarm)) and time.monotonic() < deadline:
        pass
    return records


def _status_records(model, swarm) -> dict[int, dict[str, tuple[str, int, int]]]:
    """Block index -> {peer id: (state, start, end)}, from `bloompeer status --json`."""
    result = subprocess.run([sys.executable, "-m", "bloompeer", "status", "--json", "--model", str(model),
                             "--initial-peers", *swarm.initial_peers], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return {block["index"]: {r["peer_id"]: (r["state"], r["start"], r["end"]) for r in block["servers"]}
            for block in json.loads(result.stdout)["blocks"]}
