"""`bloompeer dht`: a bootstrap peer that others join through (and that relays for peers behind NAT)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .flags import add_network_flags, network_config
from .running_peer import reachable_first, run_until_done, signal_event

__all__ = ["add_parser", "run"]

logger = logging.getLogger("bloompeer")


def add_parser(commands) -> None:
    dht = commands.add_parser("dht", help="run a bootstrap peer that others join through",
                              description="Run a bootstrap peer. Prints its multiaddrs, one per line: give one "
                                          "of them to servers and clients with --initial-peers. It also relays "
                                          "for servers behind NAT (up to 16 GiB and 24 h per connection), so "
                                          "run it where it can be reached: a public IP, or a forwarded port "
                                          "with --announce-maddrs.")
    dht.add_argument("--maddrs-file", metavar="FILE", default=None,
                     help="also write the multiaddrs to FILE once the peer is up (for scripts and containers)")
    add_network_flags(dht, "/ip4/0.0.0.0/tcp/0").add_argument(
        "--no-relay", action="store_true", help="do not relay for peers behind NAT (e.g. a swarm on one machine)")


def run(args: argparse.Namespace) -> int:
    return run_until_done(_run(args))


async def _run(args: argparse.Namespace) -> int:
    from ...p2p import PeerNode

    stop = signal_event()  # before the first line: whoever waits for it may send SIGTERM at once
    node = await PeerNode.create(network_config(args, relay_for_others=not args.no_relay))
    try:
        maddrs = await reachable_first(node)
        if args.maddrs_file:  # before the lines: who reads those may read the file next
            Path(args.maddrs_file).write_text("".join(f"{maddr}\n" for maddr in maddrs))
        for maddr in maddrs:
            print(maddr, flush=True)
        logger.info("Bootstrap peer %s is up; stop it with Ctrl-C", node.peer_id_str)
        await stop.wait()
    finally:
        await node.shutdown()
    return 0
