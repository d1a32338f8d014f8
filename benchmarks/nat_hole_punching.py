"""Decode step through two servers behind NAT: relayed vs hole-punched (root only).

Builds tests/nat/test_holepunch.py's IPv6 swarm in network namespaces (four public `bloompeer dht`
peers, a server behind each of two masquerading routers) and runs, in turns, a client that can
be punched through (listening on [::]) and one that cannot (the default 127.0.0.1), each
generating --runs times. For each run it prints the decode step's median (the first token left
out) and whether the client's connection to the servers is direct by then; at the end, over the
runs after each client's first (warm, and direct for the listening client), the median and range
of those medians, with the machine's load.

    sudo python benchmarks/nat_hole_punching.py --rounds 3 --runs 3 --new-tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' namespace helpers

from tests.nat.swarm import PAUSED_CLIENT, client_result, write_checkpoint  # noqa: E402
from tests.nat.test_holepunch import GO_LOGS, _swarm  # noqa: E402

CLIENTS = {"punched (listens on [::])": ["--host-maddrs", "/ip6/::/tcp/0", "--wait-holepunch"],
           "relayed (listens on 127.0.0.1)": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bloompeer-nat-bench-"))
    checkpoint = write_checkpoint(work / "checkpoint", hidden=64)
    (work / "logs").mkdir()
    warm = {kind: [] for kind in CLIENTS}
    for _, peers, public, servers in _swarm("ip6", checkpoint, work / "logs"):
        common = [str(checkpoint), *public, "--runs", str(args.runs), "--new-tokens", str(args.new_tokens)]
        for round_ in range(args.rounds):
            for index, (kind, extra) in enumerate(CLIENTS.items()):
                load = Path("/proc/loadavg").read_text().split()[0]
                result = client_result(peers.start(f"client{round_}-{index}", "home-c", *common, *extra,
                                                   program=PAUSED_CLIENT, env=GO_LOGS))
                medians = [statistics.median(run["step_s"][1:]) * 1000 for run in result["runs"]]
                direct = [any("/p2p-circuit" not in path for path in run["connections"].get(servers[0].peer_id_str, []))
                          for run in result["runs"]]
                print(f"round {round_} {kind}: step medians {', '.join(f'{m:.2f}' for m in medians)} ms; "
                      f"direct after each run: {direct}; load {load}", flush=True)
                warm[kind].extend(medians[1:])
    for kind, values in warm.items():
        print(f"{kind}: {len(values)} warm runs, median {statistics.median(values):.2f} ms "
              f"({min(values):.2f}-{max(values):.2f})")
    print(f"logs: {work / 'logs'}")


if __name__ == "__main__":
    main()
