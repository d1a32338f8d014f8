"""Which servers a server measures its round trips to: those that could follow it in a chain."""

from bloompeer.p2p import RequestLimits, ServerRecord, ServerState
from bloompeer.peer.server.push_rtts import next_hops
from bloompeer.weight_format import WeightFormat


def _record(peer, start, end, state=ServerState.ONLINE):
    return ServerRecord(peer, state, start, end, 1.0, 100, WeightFormat(), "0", "f", False, RequestLimits(1, 1, 1))


def test_next_hops_hold_a_block_after_one_of_ours_nearest_first():
    records = [_record("me", 2, 4), _record("after", 4, 6), _record("inside", 3, 6), _record("before", 0, 2),
               _record("same", 2, 4), _record("gone", 4, 6, ServerState.OFFLINE), _record("later", 5, 6)]
    servers = {i: [r for r in records if r.start <= i < r.end] for i in range(6)}
    # "same" holds block 3 (after our block 2): a route may switch to it there; "before" never follows us
    assert next_hops(servers, 2, 4, "me") == ["after", "inside", "same"]
