"""`bloompeer status`: who serves which blocks of a model, as the DHT says now."""

from __future__ import annotations

import argparse
import json
import logging
from typing import TYPE_CHECKING

from .default_model import DEMO_MODEL_DIR
from .flags import model_argument, network_config

if TYPE_CHECKING:
    from ..p2p import ServerRecord

__all__ = ["add_status_parser", "run_status", "format_status"]


def add_status_parser(commands, add_network_flags) -> None:
    status = commands.add_parser(
        "status", help="show which servers serve which blocks of a model",
        description="Read the swarm's DHT records for a model and print, for each block, the servers that announce "
                    "it (short peer id, state, throughput, cache room, direct or relayed); blocks nobody serves are "
                    "marked MISSING.")
    status.add_argument("--model", default=str(DEMO_MODEL_DIR), type=model_argument,
                        help="local checkpoint directory or hub name (default: the bundled demo model); only its "
                             "config is read")
    status.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    add_network_flags(status, "/ip4/127.0.0.1/tcp/0")


def _short(peer_id: str) -> str:
    return "…" + peer_id[-8:]


def format_status(model_uid: str, num_blocks: int, servers: dict[int, list[ServerRecord]]) -> str:
    """A table: one row per block, its servers; then one row per server."""
    lines = [f"{model_uid}: {num_blocks} blocks"]
    for index in range(num_blocks):
        records = sorted(servers.get(index, []), key=lambda r: r.peer_id)
        if not records:
            lines.append(f"  block {index:>4}  MISSING")
            continue
        cells = [f"{_short(r.peer_id)} {r.state.value}" for r in records]
        lines.append(f"  block {index:>4}  " + ", ".join(cells))
    by_peer = {r.peer_id: r for records in servers.values() for r in records}
    lines.append("")
    lines.append(f"  {'server':<10} {'blocks':>9} {'state':<9} {'tokens/s/block':>14} {'cache room':>11} {'reach':<8}")
    for peer_id, r in sorted(by_peer.items(), key=lambda item: (item[1].start, item[0])):
        reach = "relayed" if r.relayed else "direct"
        lines.append(f"  {_short(peer_id):<10} {f'{r.start}:{r.end}':>9} {r.state.value:<9} {r.throughput:>14.1f} "
                     f"{r.cache_tokens_left:>11} {reach:<8}")
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    import uvloop

    from ..blocks import open_checkpoint
    from ..p2p import BloompeerError, PeerNode
    from .swarm_status import status_data

    logger = logging.getLogger("bloompeer")

    async def fetch():
        checkpoint = open_checkpoint(model)
        num_blocks = checkpoint.config().n_layer
        node = await PeerNode.create(network_config(args, client_mode=True))
        try:
            return checkpoint.model_uid, num_blocks, await node.directory.find_servers(checkpoint.model_uid,
                                                                                       num_blocks)
        finally:
            await node.shutdown()

    model = args.model
    try:
        model_uid, num_blocks, servers = uvloop.run(fetch())
    except (BloompeerError, ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 1
    if args.json:
        print(json.dumps(status_data(model_uid, num_blocks, servers), indent=1))
    else:
        print(format_status(model_uid, num_blocks, servers))
    return 0
