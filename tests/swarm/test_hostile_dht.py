"""A hostile peer on the DHT: it cannot erase, overwrite or forge a server's record, nor get a
malformed record accepted, nor hang an honest lookup.

A lookup may miss a record now and then (it asks some of the peers, not all); a lookup that found
none of the victim's records is asked again, up to LOOKUP_GUARD_S. What a lookup did find is what is
asserted on, never that it found everything."""

import asyncio

import pytest
import pytest_asyncio
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from bloompeer.p2p import NetworkConfig, PeerNode, ServerState, block_key, get_dht_time

TTL_S = 60
LOOKUP_GUARD_S = 120.0


@pytest.fixture
def honest(node):
    """An honest client's view of the DHT (tests/conftest.py's client-mode peer)."""
    return node


@pytest_asyncio.fixture
async def attacker(swarm):
    """A peer with the validators (so its own writes are signed with its own key)."""
    node = await PeerNode.create(NetworkConfig(initial_peers=tuple(swarm.initial_peers)), announcing=True)
    yield node
    await node.shutdown()


def _victim(swarm):
    server = swarm.servers[0]  # blocks 0:2
    return server, server.online_line.split()[2]  # its peer process, the model uid


async def _records_of(node, model_uid, peer_id_str):
    """The victim's records under block 0, from a lookup that found some (asked again until one does)."""
    deadline = asyncio.get_running_loop().time() + LOOKUP_GUARD_S
    while True:
        servers = await node.directory.find_servers(model_uid, 4)
        records = [r for r in servers.get(0, []) if r.peer_id == peer_id_str]
        if records or asyncio.get_running_loop().time() > deadline:
            return records


async def test_a_record_cannot_be_overwritten_or_forged(swarm, honest, attacker):
    server, model_uid = _victim(swarm)
    genuine = await _records_of(honest, model_uid, server.peer_id_str)
    assert [r.state for r in genuine] == [ServerState.ONLINE]
    dht = attacker.dht
    forged = {**genuine[0].to_wire(), "state": ServerState.OFFLINE.value}
    victim_subkey = await _subkey_of(honest, model_uid, server.peer_id_str)
    expiration = get_dht_time() + TTL_S
    # 1. write under the victim's subkey: hivemind's signature validator refuses it
    assert not await dht.store(block_key(model_uid, 0), forged, expiration, subkey=victim_subkey)
    # 2. announce the victim's peer id as offline under the attacker's own subkey
    assert not await dht.store(block_key(model_uid, 0), forged, expiration, subkey=attacker.directory.subkey)
    # 3. a malformed record under the attacker's own subkey
    assert not await dht.store(block_key(model_uid, 0), {"state": "online", "start": 0}, expiration,
                               subkey=attacker.directory.subkey)
    assert await _records_of(honest, model_uid, server.peer_id_str) == genuine


def _announced(servers) -> set[tuple[int, str, ServerState]]:
    """What a lookup found, per block: which peer in which state (the shared swarm holds other tests'
    servers too, some of them draining or offline)."""
    return {(index, r.peer_id, r.state) for index, records in servers.items() for r in records}


async def _subkey_of(node, model_uid, peer_id_str):
    found = await node.dht.get(block_key(model_uid, 0), latest=True)
    return next(subkey for subkey, item in found.value.items() if item.value["peer_id"] == peer_id_str)


async def test_junk_from_a_node_without_validators_neither_hangs_nor_pollutes_lookups(swarm, honest):
    """A rogue DHT node (no validators) keeps junk under the swarm's keys, including a value that
    hivemind cannot decode (int map keys); honest lookups still answer, with only valid records."""
    server, model_uid = _victim(swarm)
    victims = {(0, server.peer_id_str, ServerState.ONLINE), (1, server.peer_id_str, ServerState.ONLINE)}
    p2p = await P2P.create(initial_peers=list(swarm.initial_peers))
    rogue = await DHTNode.create(p2p=p2p, initial_peers=list(swarm.initial_peers))
    try:
        expiration = get_dht_time() + TTL_S
        for index, junk in enumerate([{3: "int keys"}, "not a record", {"peer_id": server.peer_id_str}]):
            await rogue.store(block_key(model_uid, index), junk, expiration, subkey=b"junk%d" % index)
        deadline = asyncio.get_running_loop().time() + LOOKUP_GUARD_S
        while True:  # each lookup answers (30 s: a guard against a hang); asked again while it misses the victim
            after = _announced(await asyncio.wait_for(honest.directory.find_servers(model_uid, 4), 30))
            if victims <= after or asyncio.get_running_loop().time() > deadline:
                break
        # the victim's records as it announced them (blocks 0:2), none made of the junk naming it (block 2)
        assert {found for found in after if found[1] == server.peer_id_str} == victims
        # and every record found is a real server's of the shared swarm (other tests' included)
        known = {process.peer_id_str for process in swarm.servers
                 if any(line.startswith("/") for line in process.stdout)}
        assert {peer for _, peer, _ in after} <= known
    finally:
        await rogue.shutdown()
        await p2p.shutdown()
