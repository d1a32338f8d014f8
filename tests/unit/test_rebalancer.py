"""A --num-blocks server's looks at the swarm (rebalancer.py) on a fake directory and fake answers:
records of killed servers still say online, and only the answers tell; a second look, after the
random wait, leaves a gap that another server took in the meantime."""

from types import SimpleNamespace

import pytest

from bloompeer.p2p import RequestLimits, ServerInfo, ServerRecord, ServerState
from bloompeer.peer.server import rebalancer
from bloompeer.peer.server.block_choice import ServedSpan
from bloompeer.peer.server.current_node import CurrentNode
from bloompeer.peer.server.metrics import ServerMetrics
from bloompeer.peer.server.rebalancer import Rebalancer
from bloompeer.weight_format import WeightFormat

MODEL = "m"


def _record(peer, start, end, state=ServerState.ONLINE):
    return ServerRecord(peer, state, start, end, 1.0, 100, WeightFormat(), "0", "f", False, RequestLimits(1, 1, 1))


def _by_block(*records):
    return {i: [r for r in records if r.start <= i < r.end] for i in range(4)}


class FakeDirectory:
    """Answers each lookup with the next of `views` (the last one from then on)."""

    def __init__(self, *views):
        self.views, self.lookups = list(views), 0

    async def find_servers(self, model_uid, num_model_blocks):
        assert (model_uid, num_model_blocks) == (MODEL, 4)
        self.lookups += 1
        return self.views.pop(0) if len(self.views) > 1 else self.views[0]


@pytest.fixture
def answers(monkeypatch):
    """peer id -> a list of its answers to successive probes (None: silent); the last one repeats."""
    answers: dict[str, list] = {}

    async def fake_probe(p2p, peer_id_str, timeout_s=0.0):
        queue = answers[peer_id_str]
        return queue.pop(0) if len(queue) > 1 else queue[0]

    monkeypatch.setattr(rebalancer, "probe", fake_probe)
    return answers


def _info(start, end, state="online"):
    return ServerInfo(MODEL, start, end, state, "0", "float32", 100, 0)


def _rebalancer(directory):
    metrics = ServerMetrics()
    node = CurrentNode(SimpleNamespace(p2p=None, directory=directory, peer_id_str="me"))
    return Rebalancer(node, MODEL, 4, metrics, period_s=10.0, delay_s=0.01), metrics


def _me():
    return ServedSpan("me", 0, 2, 1.0)


async def test_records_of_killed_servers_say_online_and_their_silence_moves_a_spare(answers):
    view = _by_block(_record("me", 0, 2), _record("a", 0, 2), _record("dead1", 2, 4), _record("dead2", 2, 4))
    answers.update(a=[_info(0, 2)], dead1=[None], dead2=[None])
    looker, metrics = _rebalancer(FakeDirectory(view))
    move = await looker.check(_me)
    assert (move.start, move.end) == (2, 4) and "uncovered" in move.reason
    assert metrics.probes.labels("silent")._value.get() == 4  # two looks, two silent servers each
    assert metrics.rebalance_checks._value.get() == 1


async def test_the_second_look_leaves_a_gap_that_another_server_took_meanwhile(answers):
    before = _by_block(_record("me", 0, 2), _record("a", 0, 2), _record("dead", 2, 4))
    taken = _by_block(_record("me", 0, 2), _record("a", 0, 2), _record("dead", 2, 4),
                      _record("b", 2, 4, ServerState.JOINING))
    answers.update(a=[_info(0, 2)], dead=[None], b=[_info(2, 4, "joining")])
    # the first look reads once; the second reads before and after its probes: "b" committed in between
    directory = FakeDirectory(before, before, taken)
    looker, _ = _rebalancer(directory)
    assert await looker.check(_me) is None
    assert directory.lookups == 3


async def test_a_server_silent_once_is_not_taken_for_dead(answers):
    view = _by_block(_record("me", 0, 2), _record("a", 0, 2), _record("slow", 2, 4))
    answers.update(a=[_info(0, 2)], slow=[None, _info(2, 4)])
    looker, _ = _rebalancer(FakeDirectory(view))
    assert await looker.check(_me) is None


async def test_a_server_that_moved_away_counts_where_it_answers_it_is(answers):
    # "mover" left 2:4 for 0:2, but its old records still say online: 2:4 has no server
    view = _by_block(_record("me", 0, 2), _record("mover", 2, 4), _record("mover", 0, 2, ServerState.JOINING))
    answers.update(mover=[_info(0, 2, "joining")])
    looker, _ = _rebalancer(FakeDirectory(view))
    move = await looker.check(_me)
    assert (move.start, move.end) == (2, 4)
