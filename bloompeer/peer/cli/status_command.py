"""`bloompeer status`: who serves which blocks of a model, as the DHT says now."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .flags import add_model_flag, add_network_flags, network_config
from ..swarm_status import describe_experts, missing_blocks, status_data

if TYPE_CHECKING:
    from ...p2p import ServerRecord

__all__ = ["add_parser", "run", "format_status"]


def add_parser(commands) -> None:
    status = commands.add_parser(
        "status", help="show which servers serve which blocks of a model",
        description="Read the swarm's DHT records for a model and print, for each block, the servers that announce "
                    "it (short peer id, state, how it stores the weights, throughput, cache room, direct or "
                    "relayed); blocks nobody serves are marked MISSING.")
    add_model_flag(status, "; only its config is read")
    status.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    add_network_flags(status, "/ip4/127.0.0.1/tcp/0")
    status.set_defaults(needs_initial_peers=True)  # alone, it would find every block missing


def _short(peer_id: str) -> str:
    return "…" + peer_id[-8:]


def format_status(model_uid: str, num_model_blocks: int, servers: dict[int, list[ServerRecord]],
                  experts: Sequence[tuple[int, int]] = ()) -> str:
    """A table: one row per block, its servers; then one row per server. experts: per block, (experts,
    experts a token uses) (BlockSpan.experts_of), for a mixture of experts."""
    families = sorted({r.family for records in servers.values() for r in records})
    family = f" ({', '.join(families)} family)" if families else ""
    sparse = describe_experts(experts)
    header = f"{model_uid}{family}: {num_model_blocks} blocks" + (f"; {sparse}" if sparse else "")
    lines, missing = [header], missing_blocks(num_model_blocks, servers)
    for index in range(num_model_blocks):
        records = sorted(servers.get(index, []), key=lambda r: r.peer_id)
        cells = ", ".join(f"{_short(r.peer_id)} {r.state.value}" for r in records)
        if index in missing:
            cells = f"MISSING ({cells})" if cells else "MISSING"
        lines.append(f"  block {index:>4}  {cells}")
    # one row per server and span: a server moving to other blocks has records of both for a while
    by_span = {(r.peer_id, r.start, r.end): r for records in servers.values() for r in records}
    lines.append("")
    lines.append(f"  {'server':<10} {'blocks':>9} {'state':<9} {'weights':<8} {'tokens/s/block':>14} "
                 f"{'cache room':>11} {'reach':<8}")
    for (peer_id, _, _), r in sorted(by_span.items(), key=lambda item: (item[1].start, item[0])):
        reach = "relayed" if r.relayed else "direct"
        lines.append(f"  {_short(peer_id):<10} {f'{r.start}:{r.end}':>9} {r.state.value:<9} {r.weights.label:<8} "
                     f"{r.throughput:>14.1f} "
                     f"{r.cache_tokens_left:>11} {reach:<8}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import uvloop

    from ...blocks import open_checkpoint
    from ...p2p import PeerNode

    async def fetch():
        node = await PeerNode.create(network_config(args, client_mode=True))
        try:
            return await node.directory.find_servers(checkpoint.model_uid, num_model_blocks)
        finally:
            await node.shutdown()

    checkpoint = open_checkpoint(args.model)
    config = checkpoint.config()
    num_model_blocks, experts = config.num_hidden_layers, checkpoint.family.span_class.experts_of(config)
    servers = uvloop.run(fetch())
    if args.json:
        print(json.dumps(status_data(checkpoint.model_uid, num_model_blocks, servers, experts), indent=1))
    else:
        print(format_status(checkpoint.model_uid, num_model_blocks, servers, experts))
    return 0
