"""Choosing the relays a server behind NAT reserves on (p2p/relays.py), from records alone."""

import dataclasses

from bloompeer.p2p import (
    RELAY_SLOTS, RelaySlots, RequestLimits, ServerRecord, ServerState, announceable, relays_in_records,
)
from bloompeer.weight_format import WeightFormat

IDS = [f"12D3KooW{chr(65 + i) * 44}" for i in range(5)]  # base58, distinct


def _record(index: int, **change) -> ServerRecord:
    peer = IDS[index]
    record = ServerRecord(peer_id=peer, state=ServerState.ONLINE, start=0, end=1, throughput=1.0,
                          cache_tokens_left=1, weights=WeightFormat(), version="0", weights_fingerprint="f", relayed=False,
                          limits=RequestLimits(1, 1, 1), relay_maddrs=(_maddr(index),))
    return dataclasses.replace(record, **change)


def _maddr(index: int) -> str:
    return f"/ip4/203.0.113.{index + 1}/tcp/31337/p2p/{IDS[index]}"


def test_only_online_direct_servers_that_offer_to_relay_are_relays():
    records = [_record(0), _record(0), _record(1, relay_maddrs=()), _record(2, relayed=True),
               _record(3, state=ServerState.DRAINING), _record(4)]
    assert sorted(relays_in_records(records)) == [_maddr(0), _maddr(4)]  # one address per relay
    assert relays_in_records(records, exclude=[IDS[0]]) == [_maddr(4)]


def test_a_lost_relay_is_replaced_and_the_survivor_kept():
    slots = RelaySlots((_maddr(0), _maddr(1)))
    assert slots.circuit_maddrs == (f"{_maddr(0)}/p2p-circuit", f"{_maddr(1)}/p2p-circuit")
    after = slots.replaced([IDS[0]], [_maddr(0), _maddr(1), _maddr(2), _maddr(3)])
    assert after.relays == (_maddr(1), _maddr(2)) and len(after.relays) == RELAY_SLOTS
    assert slots.replaced([IDS[0], IDS[1]], []).relays == ()  # nothing offered: nothing left


def test_only_addresses_records_may_carry_are_announced():
    odd = f"/ip4/203.0.113.9/tcp/1/ws/p2p/{IDS[1]}"  # websockets: peers would refuse the record
    assert RelaySlots.of([_maddr(0), "/ip4/203.0.113.9/tcp/1", odd]).announced() == (
        f"{_maddr(0)}/p2p-circuit",)  # the one without a peer id is no relay at all
    assert announceable([_maddr(i) for i in range(5)] + [odd]) == tuple(_maddr(i) for i in range(4))
