"""Choosing the chain of servers that covers all blocks of a model.

A server announcing blocks [start, end) can serve any sub-range of it, so a route is a list
of (server, sub-range) pieces that tile [0, num_blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...p2p import ServerRecord, ServerState

__all__ = ["SpanRoute", "choose_route", "missing_blocks", "usable_servers"]


@dataclass(frozen=True)
class SpanRoute:
    """Blocks [start, end) on the server `peer_id_str`."""

    peer_id_str: str
    start: int
    end: int


def usable_servers(servers: dict[int, list[ServerRecord]], fingerprint: str | None) -> dict[int, list[ServerRecord]]:
    """Online servers with the client's weights, per block."""
    return {
        index: [r for r in records if r.state is ServerState.ONLINE
                and (fingerprint is None or r.weights_fingerprint == fingerprint)]
        for index, records in servers.items()
    }


def missing_blocks(servers: dict[int, list[ServerRecord]], num_blocks: int) -> list[int]:
    return [index for index in range(num_blocks) if not servers.get(index)]


def choose_route(servers: dict[int, list[ServerRecord]], num_blocks: int) -> list[SpanRoute]:
    """Fewest hops: from each uncovered block, take the server that reaches furthest.

    `servers` must cover every block (see `missing_blocks`).
    """
    route, position = [], 0
    while position < num_blocks:
        best = max(servers[position], key=lambda record: record.end)
        route.append(SpanRoute(best.peer_id, position, best.end))
        position = best.end
    return route
