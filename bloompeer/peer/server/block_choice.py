"""`serve --num-blocks K`: which K consecutive blocks to serve, at start and whenever the swarm changes.

Pure functions over what a server knows of the swarm (other servers' live spans and throughputs);
the server gathers that knowledge (rebalancer.py) and does the moving (server.py).

A block's *strength* is the summed throughput of the live servers that hold it. The swarm is as
good as its weakest blocks, so swarms are compared by their blocks' strengths sorted from weakest
up, first difference deciding (the "leximin" order): an uncovered block (strength 0) loses to any
covered one, then a stronger weakest block wins, then fewer blocks at that strength, and so on.

At start a server takes the window that leaves the swarm best in that order. Later it moves to the
best window only if that beats where it is by a clear margin at the first difference (hysteresis:
throughputs measured on different machines never agree exactly, and a move costs a reload and
replays). Every move makes the whole swarm's sorted strengths strictly better, and there are
finitely many ways to place the servers, so servers acting on a true view can never oscillate;
and a server that just chose its window is already where this rule would put it (the start choice
is a fixed point of the move rule), so it does not move again right after starting.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ...p2p import ServerInfo, ServerRecord, ServerState

__all__ = ["MOVE_MARGIN", "Move", "ServedSpan", "choose_blocks", "live_spans", "plan_move", "strengths"]

# A move must raise the strength that decides it (the weakest block that differs) by a quarter.
# Throughputs are measured once per machine; a busy machine measures its own 10-20% apart from run
# to run, so smaller differences say nothing about the swarm.
MOVE_MARGIN = 0.25
ASSUMED_THROUGHPUT = 1.0  # for a server that announced none, when nobody announced one either
LIVE_STATES = (ServerState.JOINING, ServerState.ONLINE)  # a joining server has committed to its blocks
_EQUAL = 1e-9  # relative: strengths are sums of floats


@dataclass(frozen=True)
class ServedSpan:
    """One live server as the choice sees it: blocks [start, end) at `throughput` tokens/s per block."""

    peer_id: str
    start: int
    end: int
    throughput: float


@dataclass(frozen=True)
class Move:
    """Where to go, and why (for the log)."""

    start: int
    end: int
    reason: str


def strengths(spans: Iterable[ServedSpan], num_model_blocks: int) -> list[float]:
    """Summed throughput of the spans holding each block (math.fsum: the same whatever the order)."""
    per_block: list[list[float]] = [[] for _ in range(num_model_blocks)]
    for span in spans:
        for index in range(max(0, span.start), min(num_model_blocks, span.end)):
            per_block[index].append(span.throughput)
    return [math.fsum(values) for values in per_block]


def choose_blocks(others: Sequence[ServedSpan], num_model_blocks: int, count: int,
                  throughput: float) -> tuple[int, int]:
    """The window of `count` blocks where a new server of `throughput` leaves the swarm best; on ties,
    the window whose blocks have the least throughput now, then the first."""
    if not 0 < count <= num_model_blocks:
        raise ValueError(f"--num-blocks must be between 1 and the model's {num_model_blocks} blocks, not {count}")
    return _best_window(strengths(others, num_model_blocks), count, throughput, current=None)


def plan_move(others: Sequence[ServedSpan], me: ServedSpan, num_model_blocks: int,
              margin: float = MOVE_MARGIN) -> Move | None:
    """Where `me` should move, or None to stay: to the best window for it (as choose_blocks would
    pick, staying put on ties), if the swarm with it there beats the swarm with it here by `margin`
    at the first sorted strength where the two differ."""
    others = [span for span in others if span.peer_id != me.peer_id]
    base = strengths(others, num_model_blocks)
    count = me.end - me.start
    start, end = _best_window(base, count, me.throughput, current=me.start)
    if start == me.start:
        return None
    here, there = _with(base, me.start, me.end, me.throughput), _with(base, start, end, me.throughput)
    decided = _first_difference(sorted(there), sorted(here))
    if decided is None:
        return None
    new, old = decided
    if old == 0.0:
        uncovered_here, uncovered_there = here.count(0.0), there.count(0.0)
        reason = (f"{uncovered_here} block(s) uncovered, {uncovered_there} after the move" if uncovered_there
                  else f"{uncovered_here} block(s) uncovered")
        return Move(start, end, reason)
    if new < old * (1 + margin):
        return None
    return Move(start, end, f"the weakest blocks that differ go from {old:.1f} to {new:.1f} tokens/s")


def live_spans(servers: Mapping[int, Sequence[ServerRecord]], answers: Mapping[str, ServerInfo | None],
               own_peer_id: str, model_uid: str) -> list[ServedSpan]:
    """Other servers' spans that count: joining or online in their records, and answering now with
    that span (`answers`: peer id -> its info frame, or None if it did not answer; a server not
    asked counts on its record alone). A server that moved or died leaves records that say
    online for a few announce periods: the answer tells.

    A server that announced no throughput yet (it is loading) counts as the median of those that
    did: it has committed to its blocks, and as a nearly-zero strength it would lure others there."""
    records = {}
    for block_records in servers.values():
        for record in block_records:
            if record.peer_id != own_peer_id and record.state in LIVE_STATES:
                records[(record.peer_id, record.start, record.end)] = record
    known = [record.throughput for record in records.values() if record.throughput > 0]
    assumed = statistics.median(known) if known else ASSUMED_THROUGHPUT
    spans = []
    for (peer_id, start, end), record in sorted(records.items()):
        if peer_id in answers and not _confirms(answers[peer_id], record, model_uid):
            continue
        spans.append(ServedSpan(peer_id, start, end, record.throughput or assumed))
    return spans


def _confirms(answer: ServerInfo | None, record: ServerRecord, model_uid: str) -> bool:
    return (answer is not None and answer.model == model_uid
            and (answer.start, answer.end) == (record.start, record.end)
            and answer.state in {state.value for state in LIVE_STATES})


def _with(base: list[float], start: int, end: int, throughput: float) -> list[float]:
    return [value + throughput if start <= index < end else value for index, value in enumerate(base)]


def _best_window(base: list[float], count: int, throughput: float, current: int | None) -> tuple[int, int]:
    """The window whose sorted strengths (with this server in it) are best; ties: `current`, then the
    least-served window, then the first."""
    def key(start: int) -> tuple:
        return (_Leximin(sorted(_with(base, start, start + count, throughput))), start == current,
                -math.fsum(base[start:start + count]), -start)

    start = max(range(len(base) - count + 1), key=key)
    return start, start + count


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _EQUAL * max(abs(a), abs(b))


def _first_difference(a: list[float], b: list[float]) -> tuple[float, float] | None:
    """(a's value, b's value) at the first place where the sorted lists differ, if a is the better
    there (the larger); None if they are equal or b is better."""
    for x, y in zip(a, b):
        if not _close(x, y):
            return (x, y) if x > y else None
    return None


class _Leximin:
    """Sorted strengths, ordered so that the first difference decides (floats equal within _EQUAL)."""

    def __init__(self, values: list[float]):
        self.values = values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Leximin) and all(_close(x, y) for x, y in zip(self.values, other.values))

    def __lt__(self, other: _Leximin) -> bool:
        return _first_difference(other.values, self.values) is not None
