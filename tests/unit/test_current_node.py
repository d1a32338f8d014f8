"""After a rejoin (behind NAT the daemon starts again on other relays), every part of a server speaks
through the new daemon, and the same handlers answer there: checked on fake nodes, whose P2P
records what is served and dialled on it."""

import torch

from bloompeer.p2p import (
    INFO_PROTOCOL, PUSH_PROTOCOL, NetworkConfig, PushStep, PushTarget, RelaySlots, RequestLimits, ServerRecord,
    ServerState, Step,
)
from bloompeer.peer.server.current_node import CurrentNode
from bloompeer.peer.server.metrics import ServerMetrics
from bloompeer.peer.server.push import PushSender
from bloompeer.peer.server.push_rtts import PushRtts
from bloompeer.peer.server.rebalancer import Rebalancer

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
RELAY = f"/ip4/10.0.0.1/tcp/31337/p2p/{PEER}"


class _FakeP2P:
    """Records the handlers served and the streams dialled on this daemon; every dial fails."""

    def __init__(self):
        self.served, self.dialled = [], []

    async def add_binary_stream_handler(self, protocol, handler):
        self.served.append(protocol)

    async def remove_binary_stream_handler(self, protocol):
        self.served.remove(protocol)

    async def call_binary_stream_handler(self, peer_id, protocol):
        self.dialled.append(protocol)
        raise OSError("a fake daemon")


class _FakeDirectory:
    def __init__(self):
        self.lookups = 0

    async def find_servers(self, model_uid, num_model_blocks):
        self.lookups += 1
        return {}


class _FakeNode:
    """A PeerNode whose rejoin gives `successor`."""

    peer_id_str = "me"

    def __init__(self, successor=None):
        self.p2p, self.directory, self.successor = _FakeP2P(), _FakeDirectory(), successor

    async def rejoin(self, network):
        return self.successor


async def _handler(stream):
    pass


async def test_after_a_rejoin_every_part_speaks_through_the_new_daemon_which_serves_the_same_handlers():
    new = _FakeNode()
    old = _FakeNode(successor=new)
    current = CurrentNode(old)
    pusher, push_rtts = PushSender(current, timeout_s=1.0), PushRtts(current)
    rebalancer = Rebalancer(current, "m", 4, ServerMetrics(), period_s=10.0, delay_s=0.0)
    for protocol in ("a/1", "b/1"):
        await current.serve(protocol, _handler)
    slots = RelaySlots.of([RELAY])

    await current.rejoin(NetworkConfig(), slots)

    assert current.node is new and current.relays == slots
    assert new.p2p.served == ["a/1", "b/1"]
    await pusher.push(PushTarget(PEER, "session"), PushStep("session", Step(0, torch.zeros(1, 1, 4))))
    next_hop = ServerRecord(PEER, ServerState.ONLINE, 2, 4, 1.0, 1, "float32", "0", "f", False, RequestLimits(1, 1, 1))
    await push_rtts.refresh({2: [next_hop]}, 0, 2)  # pings it
    await rebalancer.survey()
    assert old.p2p.dialled == [] and old.directory.lookups == 0
    assert set(new.p2p.dialled) == {PUSH_PROTOCOL, INFO_PROTOCOL} and new.directory.lookups == 1
    await current.stop_serving()
    assert new.p2p.served == []
