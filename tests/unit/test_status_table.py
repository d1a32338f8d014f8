"""`bloompeer status`'s table on fake records: a server moving to other blocks shows both spans."""

from bloompeer.p2p import RequestLimits, ServerRecord, ServerState
from bloompeer.peer.cli.status_command import format_status


def _record(peer, start, end, state):
    return ServerRecord(peer, state, start, end, 5.0, 100, "float32", "0", "f", False, RequestLimits(1, 1, 1))


def test_a_moving_server_has_a_row_for_each_span():
    mover = "Qm" + "m" * 44
    other = "Qm" + "o" * 44
    records = [_record(mover, 0, 2, ServerState.DRAINING), _record(mover, 2, 4, ServerState.JOINING),
               _record(other, 0, 2, ServerState.ONLINE)]
    servers = {i: [r for r in records if r.start <= i < r.end] for i in range(4)}
    table = format_status("m", 4, servers).splitlines()
    assert "  block    2  MISSING (…mmmmmmmm joining)" in table
    rows = [line.split() for line in table if line.startswith("  …")]
    assert rows == [["…mmmmmmmm", "0:2", "draining", "5.0", "100", "direct"],
                    ["…oooooooo", "0:2", "online", "5.0", "100", "direct"],
                    ["…mmmmmmmm", "2:4", "joining", "5.0", "100", "direct"]]
