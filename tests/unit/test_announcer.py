"""When a server stores its DHT record (announcer.py): once soon after going online, then every
period; and at once when the servers it could push to change. Stepped through the Announcer's own
`sleep`, on a fake node whose directory keeps what is stored."""

from types import SimpleNamespace

import pytest

from bloompeer.blocks import open_checkpoint
from bloompeer.p2p import RequestLimits, ServerRecord, ServerState, get_dht_time
from bloompeer.peer.server.announcer import NEXT_HOPS_CHECK_S, REANNOUNCE_AFTER_JOINING_S, Announcer, Standing
from bloompeer.peer.server.config import ServerConfig
from bloompeer.peer.server.current_node import CurrentNode
from bloompeer.peer.server.metrics import ServerMetrics

PERIOD_S = 30.0
NEXT_HOP = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


class _Stop(Exception):
    """Ends a loop of the announcer's from its sleep."""


class _Steps:
    """The announcer's sleep: notes each wait in `events` and returns at once; the `stop_after`th
    wait stops the loop."""

    def __init__(self, events: list, stop_after: int):
        self.events, self.left = events, stop_after

    async def __call__(self, seconds: float) -> None:
        self.events.append(seconds)
        self.left -= 1
        if not self.left:
            raise _Stop


class _Directory:
    def __init__(self, events: list, servers=None):
        self.events, self.servers, self.stored = events, servers or {}, []

    async def announce(self, model_uid, blocks, record, expiration):
        self.events.append("announce")
        self.stored.append((model_uid, blocks, record, expiration))
        return True

    async def find_servers(self, model_uid, num_model_blocks):
        return self.servers


class _P2P:
    async def call_binary_stream_handler(self, peer_id, protocol):
        raise OSError("no network here")  # a ping of a next hop fails: it is announced as far


def _announcer(checkpoint_path, directory, sleep, standing):
    node = CurrentNode(SimpleNamespace(p2p=_P2P(), directory=directory, peer_id_str="me"))
    config = ServerConfig(model=str(checkpoint_path), start=0, end=2, announce_period_s=PERIOD_S)
    return Announcer(node, config, open_checkpoint(str(checkpoint_path)), lambda: standing, ServerMetrics(),
                     sleep=sleep)


async def test_the_record_is_stored_again_soon_after_going_online_then_every_period(tiny_checkpoint):
    events = []
    directory = _Directory(events)
    online = Standing(ServerState.ONLINE, 0, 2, 12.5, 100)
    announcer = _announcer(tiny_checkpoint, directory, _Steps(events, stop_after=4), online)
    with pytest.raises(_Stop):
        await announcer.run()
    assert REANNOUNCE_AFTER_JOINING_S < PERIOD_S
    assert events == [REANNOUNCE_AFTER_JOINING_S, "announce", PERIOD_S, "announce", PERIOD_S, "announce", PERIOD_S]
    model_uid, blocks, record, expiration = directory.stored[-1]
    assert (model_uid, blocks) == (tiny_checkpoint.name, [0, 1])
    assert (record.state, record.start, record.end, record.throughput, record.cache_tokens_left) == \
        (ServerState.ONLINE, 0, 2, 12.5, 100)
    assert get_dht_time() + 2 * PERIOD_S < expiration <= get_dht_time() + 3 * PERIOD_S  # three periods ahead


def _next_hop() -> dict[int, list[ServerRecord]]:
    record = ServerRecord(NEXT_HOP, ServerState.ONLINE, 2, 4, 1.0, 1, "float32", "0", "f", False,
                          RequestLimits(1, 1, 1))
    return {2: [record], 3: [record]}


@pytest.mark.parametrize("state, announced", [(ServerState.ONLINE, 1), (ServerState.JOINING, 0)])
async def test_a_new_next_hop_is_announced_at_once_by_an_online_server(tiny_checkpoint, state, announced):
    events = []
    directory = _Directory(events, _next_hop())
    announcer = _announcer(tiny_checkpoint, directory, _Steps(events, stop_after=2), Standing(state, 0, 2, 1.0, 1))
    with pytest.raises(_Stop):
        await announcer.measure_next_hops()
    assert events == ["announce"] * announced + [NEXT_HOPS_CHECK_S, NEXT_HOPS_CHECK_S]  # the second look: no change
    assert [peer for peer, _ in announcer.record().push_rtts_s] == [NEXT_HOP]
