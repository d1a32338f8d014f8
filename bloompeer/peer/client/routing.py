"""Choosing the chain of servers for a range of blocks: the fastest way through, estimated.

A server announcing blocks [start, end) can serve any sub-range of it, so a route is a list of
(server, sub-range) pieces that tile the range. Its cost is estimated per piece as the measured
round trip to the server plus the compute time of its blocks at its announced throughput, and
the cheapest route over every way to split the range is found by a shortest path over block
boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from ...p2p import RequestLimits, ServerRecord, ServerState

__all__ = [
    "RequestSize", "SpanRoute", "choose_route", "missing_blocks", "refusal_everywhere", "usable_servers",
    "UNKNOWN_RTT_S", "RELAY_PENALTY_S",
]

UNKNOWN_RTT_S = 0.05  # a server not pinged yet is assumed this far away
UNREACHABLE_RTT_S = 5.0  # a server that did not answer its last ping: used only if nothing else serves its blocks
UNKNOWN_THROUGHPUT = 1.0  # tokens/s per block assumed for a server that announces none
RELAY_PENALTY_S = 0.01  # per relayed hop: each byte crosses the relay twice


@dataclass(frozen=True)
class SpanRoute:
    """Blocks [start, end) on the server `peer_id_str`."""

    peer_id_str: str
    start: int
    end: int

    def blocks_of(self, per_block: torch.Tensor | None) -> torch.Tensor | None:
        """This span's part of a tensor indexed by block first (deep prompts), or None."""
        return None if per_block is None else per_block[self.start:self.end]


@dataclass(frozen=True)
class RequestSize:
    """What a request asks of each server on its route, held against the limits servers announce."""

    batch: int = 1
    length: int = 1  # tokens per sequence the server holds: a session's max_length, a forward's length
    step_rows: int = 1  # rows (batch x tokens) of the largest single request (a session's prefill)

    def over_limit(self, limits: RequestLimits) -> tuple[str, int, int, str] | None:
        """(what, asked, limit, the server flag that sets it) for the first limit exceeded, or None."""
        for what, asked, limit, flag in (("batch", self.batch, limits.max_batch, "--max-batch"),
                                         ("tokens per session (prompt and new tokens)", self.length, limits.max_length,
                                          "--max-length"),
                                         ("rows (batch x tokens) per request", self.step_rows,
                                          limits.max_step_tokens, "--max-step-tokens")):
            if asked > limit:
                return what, asked, limit, flag
        return None


def refusal_everywhere(servers: dict[int, list[ServerRecord]], start: int, end: int,
                       request: RequestSize) -> str | None:
    """Why no server of some block in [start, end) could ever take `request` (None if each block has one
    that could): the limit exceeded, with the largest value on offer among that block's servers."""
    for index in range(start, end):
        records = servers.get(index, [])
        refusals = [request.over_limit(record.limits) for record in records]
        if records and all(refusals):
            what, asked, _, flag = refusals[0]
            offered = max(limit for other, _, limit, _ in refusals if other == what)
            return (f"{what} {asked} is over the limit of every server of block {index} "
                    f"(the largest on offer is {offered}; servers raise it with bloompeer serve {flag} N)")
    return None


def usable_servers(servers: dict[int, list[ServerRecord]], fingerprint: str | None,
                   trusted: Collection[str] = ()) -> dict[int, list[ServerRecord]]:
    """Online servers with the client's weights (and among `trusted`, if given), per block."""
    return {
        index: [r for r in records if r.state is ServerState.ONLINE
                and (fingerprint is None or r.weights_fingerprint == fingerprint)
                and (not trusted or r.peer_id in trusted)]
        for index, records in servers.items()
    }


def missing_blocks(servers: dict[int, list[ServerRecord]], start: int, end: int,
                   exclude: Collection[str] = ()) -> list[int]:
    """Blocks in [start, end) that no server outside `exclude` serves."""
    return [index for index in range(start, end) if not any(r.peer_id not in exclude for r in servers.get(index, ()))]


def piece_cost_s(record: ServerRecord, num_blocks: int, rtt_s: float) -> float:
    """Estimated seconds for one token through `num_blocks` of this server's blocks, and back."""
    throughput = record.throughput if record.throughput > 0 else UNKNOWN_THROUGHPUT
    return rtt_s + num_blocks / throughput + (RELAY_PENALTY_S if record.relayed else 0.0)


def choose_route(
    servers: dict[int, list[ServerRecord]], start: int, end: int, rtts_s: dict[str, float] | None = None,
    exclude: Collection[str] = (), min_cache_tokens: int = 0, request: RequestSize = RequestSize(),
) -> list[SpanRoute] | None:
    """The cheapest route through blocks [start, end), or None if some block has no usable server.

    `exclude`: peer ids not to use (banned); `min_cache_tokens`: the cache room a server must
    announce (a session's batch x max_length), or 0 for requests that keep no cache; servers
    whose announced limits `request` exceeds are never chosen.
    """
    rtts_s = rtts_s or {}
    candidates = {}
    for records in servers.values():
        for record in records:
            if (record.peer_id not in exclude and record.cache_tokens_left >= min_cache_tokens
                    and request.over_limit(record.limits) is None):
                candidates[record.peer_id] = record
    best_cost = {start: 0.0}
    best_piece: dict[int, SpanRoute] = {}
    for boundary in range(start, end):  # boundaries in order: every piece ends to the right of where it starts
        if boundary not in best_cost:
            continue
        for record in candidates.values():
            if not record.start <= boundary < record.end:
                continue
            rtt_s = min(rtts_s.get(record.peer_id, UNKNOWN_RTT_S), UNREACHABLE_RTT_S)
            for piece_end in range(boundary + 1, min(record.end, end) + 1):
                cost = best_cost[boundary] + piece_cost_s(record, piece_end - boundary, rtt_s)
                if cost < best_cost.get(piece_end, math.inf):
                    best_cost[piece_end] = cost
                    best_piece[piece_end] = SpanRoute(record.peer_id, boundary, piece_end)
    if end not in best_cost:
        return None
    route, position = [], end
    while position > start:
        piece = best_piece[position]
        route.append(piece)
        position = piece.start
    return route[::-1]
