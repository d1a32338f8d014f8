"""Choosing the relays a server behind NAT reserves on (p2p/relays.py), from records, and of
those the ones that answer (a stand-in for the daemon's connect: no process here)."""

import asyncio
import dataclasses

import pytest
from hivemind.p2p import P2PDaemonError

from bloompeer.p2p import (
    RELAY_SLOTS, RelaySlots, RequestLimits, ServerRecord, ServerState, announceable, live_relays,
    relays_in_records,
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


def test_a_lost_relay_is_replaced_by_the_survivor_first_then_the_offers_once_each():
    slots = RelaySlots((_maddr(0), _maddr(1)))
    assert slots.circuit_maddrs == (f"{_maddr(0)}/p2p-circuit", f"{_maddr(1)}/p2p-circuit")
    offered = [_maddr(1), _maddr(0), _maddr(3), _maddr(2), _maddr(3)]
    assert slots.candidates([IDS[0]], offered) == [_maddr(1), _maddr(3), _maddr(2)]
    assert slots.candidates([IDS[0], IDS[1]], []) == []  # nothing offered: nothing left


class _Daemon:
    """What live_relays asks of hivemind's P2P: `_client.connect(peer_id, maddrs)`."""

    def __init__(self, dead=(), silent=(), gone=False):
        self.dead, self.silent, self.gone, self.dialed = set(dead), set(silent), gone, []
        self._client = self

    async def connect(self, peer_id, maddrs):
        self.dialed.append(peer_id.to_base58())
        if self.gone:
            raise FileNotFoundError("the daemon's control socket")
        if peer_id.to_base58() in self.silent:
            await asyncio.sleep(60)
        if peer_id.to_base58() in self.dead:
            raise P2PDaemonError("failed to dial: all dials failed")


async def test_only_relays_that_answer_are_chosen_in_their_order():
    daemon = _Daemon(dead=[IDS[0], IDS[2]], silent=[IDS[1]])
    chosen = await live_relays(daemon, [_maddr(i) for i in range(5)], RELAY_SLOTS, timeout_s=0.1)
    assert chosen == [_maddr(3), _maddr(4)]
    assert await live_relays(daemon, [_maddr(0), _maddr(2)]) == []  # all dead: none


async def test_relays_are_dialed_a_few_at_a_time_until_enough_answer():
    daemon = _Daemon()
    assert await live_relays(daemon, [_maddr(i) for i in range(5)], 2) == [_maddr(0), _maddr(1)]
    assert daemon.dialed == IDS[:4]  # the first batch answered: the fifth was never dialed


async def test_a_daemon_that_is_gone_is_not_a_dead_relay():
    with pytest.raises(OSError):
        await live_relays(_Daemon(gone=True), [_maddr(0)])


def test_only_addresses_records_may_carry_are_announced():
    odd = f"/ip4/203.0.113.9/tcp/1/ws/p2p/{IDS[1]}"  # websockets: peers would refuse the record
    assert RelaySlots.of([_maddr(0), "/ip4/203.0.113.9/tcp/1", odd]).announced() == (
        f"{_maddr(0)}/p2p-circuit",)  # the one without a peer id is no relay at all
    assert announceable([_maddr(i) for i in range(5)] + [odd]) == tuple(_maddr(i) for i in range(4))
