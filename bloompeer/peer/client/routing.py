"""Choosing the chain of servers for a range of blocks: the fastest way through, estimated.

A server announcing blocks [start, end) can serve any sub-range of it, so a route is a list of
(server, sub-range) pieces that tile the range. Its cost is estimated per piece as the measured
round trip to the server plus the compute time of its blocks at its announced throughput, and
the cheapest route over every way to split the range is found by a shortest path over block
boundaries.

With push, a step goes client -> A -> B -> ... -> client: one way to the first server, one way
between each pair of consecutive servers (half the round trip the earlier one measured and
announced), one way back from the last. Its cheapest route is a shortest path over (boundary,
server before it). A client left to choose (ClientConfig.push None) pushes where that saves
enough over a round trip per server: between far-apart machines, not on one machine's loopback.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from ...p2p import RequestLimits, ServerRecord, ServerState
from .config import ClientConfig

__all__ = [
    "RequestSize", "RoutePlan", "ServerFilter", "SpanRoute", "choose_plan", "choose_push_route", "choose_route",
    "missing_blocks", "refusal_everywhere", "usable_servers", "why_no_route", "UNKNOWN_RTT_S", "RELAY_PENALTY_S",
]

UNKNOWN_RTT_S = 0.05  # a server not pinged yet is assumed this far away
UNREACHABLE_RTT_S = 5.0  # a server that did not answer its last ping: used only if nothing else serves its blocks
UNKNOWN_THROUGHPUT = 1.0  # tokens/s per block assumed for a server that announces none
RELAY_PENALTY_S = 0.01  # per relayed hop: each byte crosses the relay twice
# push is chosen only if it saves this much per step, and this share of the unpushed cost: on one
# machine the two are within noise of each other (benchmarks/inference.py, wan.py --delay-ms 0),
# and a loaded machine's loopback pings reach a few ms
PUSH_MIN_SAVING_S = 0.01
PUSH_MIN_SAVING_SHARE = 0.1


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


@dataclass(frozen=True)
class ServerFilter:
    """Which servers a client ever uses, for routes, replays and checks alike."""

    fingerprint: str | None  # the client's weights (None: any)
    trusted: frozenset[str] = frozenset()  # if not empty, the only peer ids used (a private swarm)
    quant: frozenset[str] | None = None  # the ways of storing weights allowed (None: any)
    # an exact client's own dtype: only servers computing in it (a bfloat16 server's results are
    # a few percent off float32's, as a quantized one's are)
    dtype: str | None = None

    @classmethod
    def of_client(cls, config: ClientConfig, fingerprint: str | None, dtype: str) -> ServerFilter:
        """What a client with `config`, the weights of `fingerprint` and local parts in `dtype` allows."""
        return cls(fingerprint, frozenset(config.trusted_servers), frozenset(config.quant_allowed),
                   dtype if config.exact else None)

    def why_not(self, record: ServerRecord) -> str | None:
        """Why the client never routes through this server (None: it may)."""
        if record.state is not ServerState.ONLINE:
            return f"{record.state.value}, not online"
        if self.fingerprint is not None and record.weights_fingerprint != self.fingerprint:
            return "other weights under this model's name"
        if self.trusted and record.peer_id not in self.trusted:
            return "not among the trusted servers"
        if self.quant is not None and record.weights.quant not in self.quant:
            return f"weights stored as {record.weights.quant}, which this client does not allow"
        if self.dtype is not None and record.weights.dtype != self.dtype:
            return f"computes in {record.weights.dtype}, and this client asks for exact {self.dtype} results"
        return None


def usable_servers(servers: dict[int, list[ServerRecord]], allowed: ServerFilter) -> dict[int, list[ServerRecord]]:
    """The servers `allowed` lets the client use, per block."""
    return {index: [r for r in records if allowed.why_not(r) is None] for index, records in servers.items()}


def why_no_route(announced: dict[int, list[ServerRecord]], start: int, end: int, allowed: ServerFilter,
                 banned: Collection[str] = (), min_cache_tokens: int = 0) -> str:
    """What the DHT shows for the first block in [start, end) that no usable server with cache room
    serves: nobody announcing it, or each of its servers and why it was passed over."""
    for index in range(start, end):
        records = announced.get(index, [])
        if not records:
            return f"no server announces block {index}"
        reasons = [allowed.why_not(r)
                   or ("not used for now after failing" if r.peer_id in banned else None)
                   or (f"{r.cache_tokens_left} cache tokens left of the {min_cache_tokens} needed"
                       if r.cache_tokens_left < min_cache_tokens else None) for r in records]
        if all(reasons):
            return f"block {index} is announced by " + "; ".join(
                f"...{r.peer_id[-8:]} ({reason})" for r, reason in zip(records, reasons))
    return "their servers do not join up into one chain"


def missing_blocks(servers: dict[int, list[ServerRecord]], start: int, end: int,
                   exclude: Collection[str] = ()) -> list[int]:
    """Blocks in [start, end) that no server outside `exclude` serves."""
    return [index for index in range(start, end) if not any(r.peer_id not in exclude for r in servers.get(index, ()))]


def piece_cost_s(record: ServerRecord, num_blocks: int, rtt_s: float) -> float:
    """Estimated seconds for one token through `num_blocks` of this server's blocks, and back."""
    throughput = record.throughput if record.throughput > 0 else UNKNOWN_THROUGHPUT
    return rtt_s + num_blocks / throughput + (RELAY_PENALTY_S if record.relayed else 0.0)


def _candidates(servers: dict[int, list[ServerRecord]], exclude: Collection[str], min_cache_tokens: int,
                request: RequestSize) -> dict[str, ServerRecord]:
    candidates = {}
    for records in servers.values():
        for record in records:
            if (record.peer_id not in exclude and record.cache_tokens_left >= min_cache_tokens
                    and request.over_limit(record.limits) is None):
                candidates[record.peer_id] = record
    return candidates


def _client_rtt_s(rtts_s: dict[str, float], peer_id: str) -> float:
    return min(rtts_s.get(peer_id, UNKNOWN_RTT_S), UNREACHABLE_RTT_S)


def _hop_rtt_s(before: ServerRecord, after: ServerRecord) -> float:
    """The round trip between two servers, as either of them announced it (the earlier one's first)."""
    rtt_s = before.push_rtt_s(after.peer_id)
    if rtt_s is None:
        rtt_s = after.push_rtt_s(before.peer_id)
    return min(UNKNOWN_RTT_S if rtt_s is None else rtt_s, UNREACHABLE_RTT_S)


@dataclass(frozen=True)
class RoutePlan:
    """A route, whether steps are pushed along it, and its estimated seconds per step."""

    route: list[SpanRoute]
    push: bool
    cost_s: float


def choose_plan(
    servers: dict[int, list[ServerRecord]], start: int, end: int, rtts_s: dict[str, float] | None = None,
    exclude: Collection[str] = (), min_cache_tokens: int = 0, request: RequestSize = RequestSize(),
    push: bool | None = False,
) -> RoutePlan | None:
    """The cheapest route through blocks [start, end) without push (push False), with push (True),
    or whichever saves enough (None); None if some block has no usable server. Arguments as in
    choose_route."""
    plans = []
    if push is not True:
        plans.append(_plan(servers, start, end, rtts_s, exclude, min_cache_tokens, request, False))
    if push is not False:
        plans.append(_plan(servers, start, end, rtts_s, exclude, min_cache_tokens, request, True))
    plans = [plan for plan in plans if plan is not None]
    if not plans:
        return None
    if len(plans) == 2:
        direct, pushed = plans
        saving_s = direct.cost_s - pushed.cost_s
        worth_it = saving_s >= PUSH_MIN_SAVING_S and saving_s >= PUSH_MIN_SAVING_SHARE * direct.cost_s
        return pushed if worth_it and len(pushed.route) > 1 else direct
    return plans[0]


def _plan(servers, start, end, rtts_s, exclude, min_cache_tokens, request, push: bool) -> RoutePlan | None:
    choose = choose_push_route if push else choose_route
    found = choose(servers, start, end, rtts_s, exclude, min_cache_tokens, request, with_cost=True)
    return None if found is None else RoutePlan(found[0], push, found[1])


def choose_push_route(
    servers: dict[int, list[ServerRecord]], start: int, end: int, rtts_s: dict[str, float] | None = None,
    exclude: Collection[str] = (), min_cache_tokens: int = 0, request: RequestSize = RequestSize(),
    with_cost: bool = False,
):
    """The cheapest route through blocks [start, end) for pushed steps, costed with the servers'
    announced round trips to each other; arguments and result as in choose_route."""
    rtts_s = rtts_s or {}
    candidates = _candidates(servers, exclude, min_cache_tokens, request)
    # state: (boundary, peer id of the piece ending there, or None at the start) -> cost, piece
    best_cost: dict[tuple[int, str | None], float] = {(start, None): 0.0}
    best_piece: dict[tuple[int, str | None], tuple[SpanRoute, str | None]] = {}
    for boundary in range(start, end):
        arrived = [(before_id, cost) for (at, before_id), cost in best_cost.items() if at == boundary]
        for before_id, cost_so_far in arrived:
            before = candidates.get(before_id)
            for record in candidates.values():
                if not record.start <= boundary < record.end or record.peer_id == before_id:
                    continue
                hop_s = (_client_rtt_s(rtts_s, record.peer_id) if before is None else _hop_rtt_s(before, record)) / 2
                for piece_end in range(boundary + 1, min(record.end, end) + 1):
                    cost = cost_so_far + hop_s + piece_cost_s(record, piece_end - boundary, 0.0)
                    if piece_end == end:
                        cost += _client_rtt_s(rtts_s, record.peer_id) / 2  # the last server answers the client
                    state = (piece_end, record.peer_id)
                    if cost < best_cost.get(state, math.inf):
                        best_cost[state] = cost
                        best_piece[state] = (SpanRoute(record.peer_id, boundary, piece_end), before_id)
    finals = [(cost, state) for state, cost in best_cost.items() if state[0] == end and state[1] is not None]
    if not finals:
        return None
    cost, state = min(finals)
    route = []
    while state[1] is not None:
        piece, before_id = best_piece[state]
        route.append(piece)
        state = (piece.start, before_id)
    return (route[::-1], cost) if with_cost else route[::-1]


def choose_route(
    servers: dict[int, list[ServerRecord]], start: int, end: int, rtts_s: dict[str, float] | None = None,
    exclude: Collection[str] = (), min_cache_tokens: int = 0, request: RequestSize = RequestSize(),
    with_cost: bool = False,
):
    """The cheapest route through blocks [start, end) (with its estimated seconds per step if
    `with_cost`), or None if some block has no usable server.

    `exclude`: peer ids not to use (banned); `min_cache_tokens`: the cache room a server must
    announce (a session's batch x max_length), or 0 for requests that keep no cache; servers
    whose announced limits `request` exceeds are never chosen.
    """
    rtts_s = rtts_s or {}
    candidates = _candidates(servers, exclude, min_cache_tokens, request)
    best_cost = {start: 0.0}
    best_piece: dict[int, SpanRoute] = {}
    for boundary in range(start, end):  # boundaries in order: every piece ends to the right of where it starts
        if boundary not in best_cost:
            continue
        for record in candidates.values():
            if not record.start <= boundary < record.end:
                continue
            rtt_s = _client_rtt_s(rtts_s, record.peer_id)
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
    return (route[::-1], best_cost[end]) if with_cost else route[::-1]
