"""A client that generates greedily through the swarm, optionally pausing once for the test to act.

Run inside a namespace by the NAT tests:
    python paused_client.py CHECKPOINT INITIAL_PEER... [--runs N] [--pause-at K --go-file F] [--host-maddrs M...]
It generates N times. With --wait-holepunch it first waits until its daemon serves hole punching
(libp2p starts it once four peers have observed one public address of ours, and checks for that
on a backoff of 0.25 to 5 s; its log says when: run with GOLOG_LOG_LEVEL=p2p-holepunch=debug).
With --pause-at, it prints `paused <route>` at the K-th token of the first
run and waits until F exists (the test kills a relay meanwhile). With --join-after-go, it prints
`ready` once its imports are done and waits until F exists before it joins the swarm at all: a
fresh client, timed from then (its imports alone took 24 s once here, on loaded cores); a number
in F is its --give-up-at. With --give-up-at T (seconds since the epoch, time.time()), it waits
for missing blocks and re-routes around failing servers only until T, and at T shuts its client
down, so that a generation still running fails then. At the end it prints one JSON line: per run,
the new tokens, how long each token took and the addresses its daemon is then connected to each
peer at; the sessions it replayed; its own addresses; when it finished (time.time()); and, if
generating failed, the error.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from bloompeer import ClientConfig, DistributedBloomForCausalLM, NetworkConfig

PROMPT = torch.tensor([[1, 30, 31, 32, 33]])
HOLEPUNCH_WAIT_S = 60.0


class _Replays(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("Replaying")


class _HolePunchReady(logging.Handler):
    """Set once the daemon's log says its hole punching service started."""

    def __init__(self):
        super().__init__()
        self.ready = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "Starting holepunch protocol" in record.getMessage():
            self.ready.set()


class _PauseAndTime(LogitsProcessor):
    """Called once per new token, in generate's loop: times the tokens, and pauses at one."""

    def __init__(self, model, pause_at: int, go_file: Path | None):
        self.model, self.pause_at, self.go_file = model, pause_at, go_file
        self.calls, self.times = 0, [time.monotonic()]

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.pause_at:
            route = " ".join(f"{s.peer_id_str}[{s.start}:{s.end}]" for s in self.model.active_session.route)
            print(f"paused {route}", flush=True)
            _wait_for(self.go_file)
            self.times.append(time.monotonic())  # the pause is no token's time
        self.times.append(time.monotonic())
        return scores

    @property
    def step_s(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.times, self.times[1:])]


async def _connections(p2p) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for info in await p2p.list_peers():
        found.setdefault(info.peer_id.to_base58(), []).extend(str(addr) for addr in info.addrs)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("initial_peers", nargs="+")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--pause-at", type=int, default=0)
    parser.add_argument("--go-file", type=Path)
    parser.add_argument("--host-maddrs", nargs="+", default=None)
    parser.add_argument("--wait-holepunch", action="store_true")
    parser.add_argument("--join-after-go", action="store_true")
    parser.add_argument("--give-up-at", type=float, default=None)
    args = parser.parse_args()
    if args.join_after_go:
        print("ready", flush=True)
        _wait_for(args.go_file)
        said = args.go_file.read_text().strip()
        args.give_up_at = float(said) if said else args.give_up_at
    replays, holepunch = _Replays(), _HolePunchReady()
    logging.getLogger("bloompeer").addHandler(replays)
    logging.getLogger("bloompeer").addHandler(_stderr_log())  # routes, bans, replays: in the test's log file
    logging.getLogger("bloompeer").setLevel(logging.INFO)
    daemon_log = logging.getLogger("hivemind.p2p.p2p_daemon")  # p2pd's own lines come through it, at DEBUG
    daemon_log.addHandler(holepunch)
    daemon_log.setLevel(logging.DEBUG)
    network = NetworkConfig(initial_peers=tuple(args.initial_peers), client_mode=True,
                            **({"host_maddrs": tuple(args.host_maddrs)} if args.host_maddrs else {}))
    config = ClientConfig(network, request_timeout_s=3.0, swarm_refresh_period_s=1.0, poll_period_s=0.5,
                          **_bounded(args.give_up_at))
    model = DistributedBloomForCausalLM.from_pretrained(args.checkpoint, client_config=config)
    client = model.remote.client
    if args.wait_holepunch and not holepunch.ready.wait(HOLEPUNCH_WAIT_S):
        raise SystemExit(f"the daemon did not start hole punching within {HOLEPUNCH_WAIT_S:.0f} s")
    give_up = threading.Timer(max(0.0, args.give_up_at - time.time()), client.shutdown) if args.give_up_at else None
    if give_up is not None:
        give_up.daemon = True
        give_up.start()
    runs, own, error = [], [], None
    try:
        for run in range(args.runs):
            timer = _PauseAndTime(model, args.pause_at if run == 0 else 0, args.go_file)
            with torch.inference_mode():
                tokens = model.generate(PROMPT, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                        do_sample=False, logits_processor=LogitsProcessorList([timer]))
            runs.append({"tokens": tokens[0, PROMPT.shape[1]:].tolist(), "step_s": timer.step_s,
                         "connections": client.runtime.run(_connections(client.node.p2p))})
        own = client.runtime.run(client.node.visible_maddrs())
    except Exception as exc:  # noqa: BLE001 - reported to the test, which says what failed
        if args.give_up_at is None:
            raise
        error = repr(exc)
    finished_at = time.time()
    if give_up is not None:
        give_up.cancel()
    print(json.dumps({"runs": runs, "replays": replays.count, "own_maddrs": own, "finished_at": finished_at,
                      **({"error": error} if error else {})}), flush=True)


def _wait_for(go_file: Path) -> None:
    while not go_file.exists():
        time.sleep(0.05)


def _stderr_log() -> logging.Handler:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    return handler


def _bounded(give_up_at: float | None) -> dict[str, float]:
    """ClientConfig's waits for a client that gives up at `give_up_at` (time.time()): what is left until then."""
    if give_up_at is None:
        return {}
    left_s = max(0.0, give_up_at - time.time())
    return {"missing_blocks_timeout_s": left_s, "recovery_timeout_s": left_s}


if __name__ == "__main__":
    main()
