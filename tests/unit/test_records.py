import dataclasses

import pytest

from bloompeer.p2p import MAX_PUSH_RTTS, ProtocolError, RequestLimits, ServerRecord, ServerState, block_key
from bloompeer.weight_format import WeightFormat

RECORD = ServerRecord(peer_id="12D3KooWabc", state=ServerState.ONLINE, start=0, end=4, throughput=12.5,
                      cache_tokens_left=4096, weights=WeightFormat(), version="0.1.0", weights_fingerprint="ab12",
                      relayed=False, limits=RequestLimits(max_batch=64, max_length=8192, max_step_tokens=65536))


def test_round_trip():
    assert ServerRecord.from_wire(RECORD.to_wire()) == RECORD
    assert block_key("bloom-560m", 3) == "bloom-560m.3"


def test_push_round_trips_travel_and_old_records_still_decode():
    measured = dataclasses.replace(RECORD, push_rtts_s=(("12D3KooWnext", 0.1), ("QmOther", 2)))
    wire = measured.to_wire()
    assert wire["push_rtts_s"] == {"12D3KooWnext": 0.1, "QmOther": 2}
    decoded = ServerRecord.from_wire(wire)
    assert decoded == dataclasses.replace(measured, push_rtts_s=(("12D3KooWnext", 0.1), ("QmOther", 2.0)))
    assert decoded.push_rtt_s("QmOther") == 2.0 and decoded.push_rtt_s("QmNobody") is None
    assert "push_rtts_s" not in RECORD.to_wire()  # nothing measured: the record of versions before the field
    assert ServerRecord.from_wire(RECORD.to_wire()).push_rtts_s == ()


def test_the_family_travels_and_records_before_the_field_read_as_bloom():
    llama = dataclasses.replace(RECORD, family="llama")
    assert ServerRecord.from_wire(llama.to_wire()).family == "llama"
    wire = RECORD.to_wire()
    del wire["family"]
    assert ServerRecord.from_wire(wire).family == "bloom"


def test_the_weight_format_travels_and_records_before_its_fields_read_as_float_on_the_cpu():
    int4 = dataclasses.replace(RECORD, weights=WeightFormat("int4", 32, "bfloat16", "cuda"))
    wire = int4.to_wire()
    assert (wire["quant"], wire["quant_group_size"], wire["dtype"], wire["device"]) == ("int4", 32, "bfloat16", "cuda")
    assert ServerRecord.from_wire(wire) == int4
    int8_on_cuda = dataclasses.replace(RECORD, weights=WeightFormat("int8", device="cuda"))
    assert ServerRecord.from_wire(int8_on_cuda.to_wire()) == int8_on_cuda
    assert not {"quant", "quant_group_size", "device"} & set(RECORD.to_wire())  # as before the fields
    assert ServerRecord.from_wire(RECORD.to_wire()).weights == WeightFormat("none", 0, "float32", "cpu")


@pytest.mark.parametrize("storage", [
    {"quant": "int3"}, {"quant": 8}, {"quant": "int4"}, {"quant": "int4", "quant_group_size": 48},
    {"quant": "int4", "quant_group_size": 64.0}, {"quant": "int8", "quant_group_size": 64},
    {"quant": "none", "quant_group_size": 64}, {"quant_group_size": 64}, {"quant": "int4", "quant_group_size": True},
])
def test_malformed_weight_storage_is_refused(storage):
    with pytest.raises(ProtocolError):
        ServerRecord.from_wire({**RECORD.to_wire(), **storage})


@pytest.mark.parametrize("push_rtts", [
    [], "QmA", {"QmA": -0.1}, {"QmA": float("nan")}, {"QmA": float("inf")}, {"QmA": 61.0}, {"QmA": "0.1"},
    {"QmA": True}, {"": 0.1}, {"x" * 129: 0.1}, {f"Qm{i}": 0.1 for i in range(MAX_PUSH_RTTS + 1)},
])
def test_malformed_push_round_trips_are_refused(push_rtts):
    with pytest.raises(ProtocolError):
        ServerRecord.from_wire({**RECORD.to_wire(), "push_rtts_s": push_rtts})


@pytest.mark.parametrize("change", [
    {"state": "sleeping"}, {"start": -1}, {"end": 0}, {"end": "4"}, {"throughput": float("nan")},
    {"throughput": -1.0}, {"cache_tokens_left": 1.5}, {"relayed": 1}, {"peer_id": ""}, {"extra": 1},
    {"limits": None}, {"dtype": "int8"}, {"dtype": "float64"}, {"device": "cuda:0"}, {"device": "tpu"},
    {"family": ""}, {"family": 3}, {"family": "x" * 33},
    {"limits": {"max_batch": 1, "max_length": 2}}, {"limits": {"max_batch": 0, "max_length": 2, "max_step_tokens": 3}},
    {"limits": {"max_batch": 1, "max_length": 2.0, "max_step_tokens": 3}},
])
def test_malformed_records_are_refused(change):
    with pytest.raises(ProtocolError):
        ServerRecord.from_wire({**RECORD.to_wire(), **change})


def test_missing_field_is_refused():
    wire = RECORD.to_wire()
    del wire["dtype"]
    with pytest.raises(ProtocolError):
        ServerRecord.from_wire(wire)


SERVER_ID = "12D3KooWMeD1uz7bKumjkShHmtsRLmd95WnuArwVvTgmC4cdxWaD"
RELAY_ID = "QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51"
RELAY_MADDR = f"/ip4/203.0.113.5/tcp/31337/p2p/{RELAY_ID}"


def test_relay_addresses_travel_and_records_before_the_fields_read_as_none():
    relay = dataclasses.replace(RECORD, peer_id=SERVER_ID, relay_maddrs=(
        f"/ip4/203.0.113.7/tcp/31338/p2p/{SERVER_ID}", f"/ip6/3fff:99::7/udp/31338/quic-v1/p2p/{SERVER_ID}"))
    assert ServerRecord.from_wire(relay.to_wire()) == relay
    relayed = dataclasses.replace(RECORD, relayed=True, via_relays=(f"{RELAY_MADDR}/p2p-circuit",))
    assert ServerRecord.from_wire(relayed.to_wire()) == relayed
    assert not {"relay_maddrs", "via_relays"} & set(RECORD.to_wire())  # as versions before the fields wrote it
    assert ServerRecord.from_wire(RECORD.to_wire()).relay_maddrs == ()


@pytest.mark.parametrize("change", [
    {"relay_maddrs": f"/ip4/203.0.113.7/tcp/1/p2p/{SERVER_ID}"},  # not a list
    {"relay_maddrs": [RELAY_MADDR]},  # another peer's address
    {"relay_maddrs": [f"/ip4/203.0.113.7/tcp/1/p2p/{SERVER_ID}"] * 5},  # too many
    {"relay_maddrs": [f"/ip4/203.0.113.7/tcp/1/p2p/{SERVER_ID}/p2p-circuit"]},
    {"relay_maddrs": [f"/ip4/203.0.113.999/tcp/1/p2p/{SERVER_ID}"]},
    {"relay_maddrs": [f"/ip4/203.0.113.7/tcp/70000/p2p/{SERVER_ID}"]},
    {"relay_maddrs": [f"/ip4/203.0.113.7/udp/1/p2p/{SERVER_ID}"]},  # UDP that is not QUIC
    {"relay_maddrs": [f"/unix/tmp/x/p2p/{SERVER_ID}"]}, {"relay_maddrs": [f"/dns/a;rm -rf/tcp/1/p2p/{SERVER_ID}"]},
    {"relay_maddrs": ["/ip4/203.0.113.7/tcp/1/p2p/" + "1" * 300]}, {"relay_maddrs": [3]},
    {"via_relays": [RELAY_MADDR]},  # not a circuit address
    {"via_relays": [f"/ip4/1.2.3.4/tcp/1/p2p-circuit"]}, {"via_relays": [f"{RELAY_MADDR}/p2p-circuit"] * 5},
    {"via_relays": [f"{RELAY_MADDR}/p2p/{SERVER_ID}/p2p-circuit"]},
])
def test_malformed_relay_addresses_are_refused(change):
    with pytest.raises(ProtocolError):
        ServerRecord.from_wire({**dataclasses.replace(RECORD, peer_id=SERVER_ID).to_wire(), **change})
