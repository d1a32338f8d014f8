from bloompeer.p2p import ServerRecord, ServerState
from bloompeer.peer.client.errors import MissingBlocksError, block_ranges
from bloompeer.peer.client.routing import SpanRoute, choose_route, missing_blocks, usable_servers


def _record(peer, start, end, state=ServerState.ONLINE, fingerprint="f"):
    return ServerRecord(peer, state, start, end, 1.0, 100, "float32", "0", fingerprint, False)


def _by_block(records, num_blocks):
    return {i: [r for r in records if r.start <= i < r.end] for i in range(num_blocks)}


def test_route_covers_all_blocks_with_fewest_hops():
    servers = _by_block([_record("a", 0, 3), _record("b", 1, 6), _record("c", 3, 6)], 6)
    assert choose_route(servers, 6) == [SpanRoute("a", 0, 3), SpanRoute("b", 3, 6)]


def test_unusable_servers_are_dropped():
    records = [_record("a", 0, 2), _record("b", 2, 4, ServerState.DRAINING), _record("c", 2, 4, fingerprint="other")]
    servers = usable_servers(_by_block(records, 4), "f")
    assert missing_blocks(servers, 4) == [2, 3]


def test_missing_blocks_message_names_ranges():
    assert block_ranges([0, 1, 2, 5, 7, 8]) == "0:3, 5:6, 7:9"
    message = str(MissingBlocksError("bloom", [2, 3], 5.0))
    assert "2:4" in message and "bloompeer serve" in message
