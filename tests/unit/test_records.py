import pytest

from bloompeer.p2p import ProtocolError, RequestLimits, ServerRecord, ServerState, block_key

RECORD = ServerRecord(peer_id="12D3KooWabc", state=ServerState.ONLINE, start=0, end=4, throughput=12.5,
                      cache_tokens_left=4096, dtype="float32", version="0.1.0", weights_fingerprint="ab12",
                      relayed=False, limits=RequestLimits(max_batch=64, max_length=8192, max_step_tokens=65536))


def test_round_trip():
    assert ServerRecord.from_wire(RECORD.to_wire()) == RECORD
    assert block_key("bloom-560m", 3) == "bloom-560m.3"


@pytest.mark.parametrize("change", [
    {"state": "sleeping"}, {"start": -1}, {"end": 0}, {"end": "4"}, {"throughput": float("nan")},
    {"throughput": -1.0}, {"cache_tokens_left": 1.5}, {"relayed": 1}, {"peer_id": ""}, {"extra": 1},
    {"limits": None}, {"limits": {"max_batch": 1, "max_length": 2}}, {"limits": {"max_batch": 0, "max_length": 2,
    "max_step_tokens": 3}}, {"limits": {"max_batch": 1, "max_length": 2.0, "max_step_tokens": 3}},
])
def test_malformed_records_are_refused(change):
    with pytest.raises(ProtocolError):
        ServerRecord.from_wire({**RECORD.to_wire(), **change})


def test_missing_field_is_refused():
    wire = RECORD.to_wire()
    del wire["dtype"]
    with pytest.raises(ProtocolError):
        ServerRecord.from_wire(wire)
