"""Where --num-blocks servers go, at start and later: block_choice.py on fake swarms."""

import random

import pytest

from bloompeer.p2p import RequestLimits, ServerInfo, ServerRecord, ServerState
from bloompeer.peer.server.block_choice import (
    MOVE_MARGIN, ServedSpan, choose_blocks, live_spans, plan_move, strengths,
)
from bloompeer.weight_format import WeightFormat


def _span(peer, start, end, throughput=1.0):
    return ServedSpan(peer, start, end, throughput)


def test_a_spare_server_moves_to_an_uncovered_range_and_the_last_server_of_a_range_stays():
    # blocks 2:4 lost both their servers; "spare" holds 0:2 beside "a", "b" holds 0:2 alone once spare leaves
    others = [_span("a", 0, 2)]
    move = plan_move(others, _span("spare", 0, 2), num_model_blocks=4)
    assert (move.start, move.end) == (2, 4) and "uncovered" in move.reason
    # the only server of 0:2 would uncover its own blocks to cover others: nothing gained
    assert plan_move([], _span("alone", 0, 2), num_model_blocks=4) is None


def test_a_move_that_covers_part_of_a_gap_is_made():
    move = plan_move([_span("a", 0, 2), _span("b", 0, 2)], _span("spare", 0, 2), num_model_blocks=6)
    assert (move.start, move.end) in {(2, 4), (3, 5), (4, 6)}
    assert "4 block(s) uncovered, 2 after the move" in move.reason


def test_hysteresis_a_small_gain_is_not_worth_a_move():
    # us (1.1) and a, c on 0:2, b (1.2) alone on 2:4: moving there makes the weakest blocks 2.0 instead of 1.2
    move = plan_move([_span("a", 0, 2), _span("b", 2, 4, 1.2), _span("c", 0, 2)], _span("me", 0, 2, 1.1), 4)
    assert (move.start, move.end) == (2, 4) and "from 1.2 to 2.0" in move.reason
    # b at 1.9: the move would raise the weakest blocks from 1.9 to 2.0 only
    assert plan_move([_span("a", 0, 2), _span("c", 0, 2), _span("b", 2, 4, 1.9)], _span("me", 0, 2), 4) is None
    # just past the margin, and just short of it
    weak = 2.0 / (1 + MOVE_MARGIN) - 0.01
    assert plan_move([_span("a", 0, 2), _span("c", 0, 2), _span("b", 2, 4, weak)], _span("me", 0, 2), 4) is not None
    weak = 2.0 / (1 + MOVE_MARGIN) + 0.01
    assert plan_move([_span("a", 0, 2), _span("c", 0, 2), _span("b", 2, 4, weak)], _span("me", 0, 2), 4) is None


def test_ties_keep_a_server_where_it_is():
    # 0:2 and 2:4 equally served: staying and moving leave the same swarm
    others = [_span("a", 0, 2), _span("b", 2, 4), _span("c", 2, 4)]
    assert plan_move(others, _span("me", 0, 2), 4) is None
    assert plan_move([_span("a", 0, 2), _span("b", 2, 4)], _span("me", 1, 3), 4) is None


def test_the_start_choice_fills_the_model_before_doubling_up_and_breaks_ties_to_the_least_served():
    assert choose_blocks([], 4, 2, 1.0) == (0, 2)
    assert choose_blocks([_span("a", 0, 2)], 4, 2, 1.0) == (2, 4)
    assert choose_blocks([_span("a", 0, 2), _span("b", 2, 4)], 4, 3, 1.0) == (0, 3)
    # 1:3 and 2:4 leave the same weakest blocks (strength 1 at 0 or 3); 2:4's blocks have less now
    assert choose_blocks([_span("a", 0, 3), _span("b", 1, 3)], 4, 2, 1.0) == (2, 4)
    with pytest.raises(ValueError, match="--num-blocks"):
        choose_blocks([], 4, 5, 1.0)


def _random_swarm(rng: random.Random, num_blocks: int) -> list[ServedSpan]:
    spans = []
    for index in range(rng.randint(1, 12)):
        count = rng.randint(1, num_blocks)
        start = rng.randint(0, num_blocks - count)
        spans.append(_span(f"s{index}", start, start + count, rng.choice([1.0, 1.0, 2.0, 0.5, rng.uniform(0.3, 3)])))
    return spans


def _sorted_strengths(spans, num_blocks):
    return sorted(strengths(spans, num_blocks))


@pytest.mark.parametrize("seed", range(40))
def test_servers_acting_in_turn_settle_and_every_move_improves_the_swarm(seed):
    """No oscillation: servers that each look and move in turn (any order) stop moving, and each move makes
    the whole swarm's sorted strengths better (the order that plan_move optimizes), so no arrangement repeats."""
    rng = random.Random(seed)
    num_blocks = rng.randint(2, 10)
    swarm = {span.peer_id: span for span in _random_swarm(rng, num_blocks)}
    seen = {tuple(sorted(swarm.values(), key=lambda s: s.peer_id))}
    moves = 0
    for _ in range(100):
        moved = False
        for peer in rng.sample(sorted(swarm), len(swarm)):
            before = _sorted_strengths(swarm.values(), num_blocks)
            move = plan_move(list(swarm.values()), swarm[peer], num_blocks)
            if move is None:
                continue
            swarm[peer] = _span(peer, move.start, move.end, swarm[peer].throughput)
            after = _sorted_strengths(swarm.values(), num_blocks)
            first_difference = next((a, b) for a, b in zip(after, before) if abs(a - b) > 1e-9)
            assert first_difference[0] > first_difference[1], (before, after)
            arrangement = tuple(sorted(swarm.values(), key=lambda s: s.peer_id))
            assert arrangement not in seen
            seen.add(arrangement)
            moved, moves = True, moves + 1
        if not moved:
            break
    else:
        pytest.fail(f"still moving after 100 rounds ({moves} moves)")
    assert all(plan_move(list(swarm.values()), span, num_blocks) is None for span in swarm.values())


@pytest.mark.parametrize("seed", range(40))
def test_a_server_that_just_chose_its_blocks_does_not_move_right_away(seed):
    rng = random.Random(seed)
    num_blocks = rng.randint(1, 10)
    others = _random_swarm(rng, num_blocks)
    count, throughput = rng.randint(1, num_blocks), rng.choice([1.0, 2.0, 0.7])
    start, end = choose_blocks(others, num_blocks, count, throughput)
    assert plan_move(others, _span("new", start, end, throughput), num_blocks) is None


def _record(peer, start, end, state=ServerState.ONLINE, throughput=2.0):
    return ServerRecord(peer, state, start, end, throughput, 100, WeightFormat(), "0", "f", False, RequestLimits(1, 1, 1))


def _info(start, end, state="online", model="m"):
    return ServerInfo(model, start, end, state, "0", "float32", 100, 0)


def test_live_spans_count_servers_that_answer_with_their_records_span():
    records = [_record("alive", 0, 2), _record("dead", 2, 4), _record("moved", 0, 2), _record("moved", 2, 4,
               ServerState.JOINING), _record("loading", 1, 3, ServerState.JOINING, throughput=0.0),
               _record("leaving", 0, 4, ServerState.DRAINING), _record("gone", 0, 4, ServerState.OFFLINE),
               _record("me", 0, 4), _record("unasked", 3, 4), _record("other-model", 0, 1)]
    servers = {i: [r for r in records if r.start <= i < r.end] for i in range(4)}
    answers = {"alive": _info(0, 2), "dead": None, "moved": _info(2, 4, "joining"), "loading": _info(1, 3, "joining"),
               "leaving": _info(0, 4, "draining"), "me": None, "other-model": _info(0, 1, model="n")}
    spans = live_spans(servers, answers, "me", "m")
    # "loading" announced no throughput yet: it counts as the median of those that did (2.0)
    assert spans == [_span("alive", 0, 2, 2.0), _span("loading", 1, 3, 2.0), _span("moved", 2, 4, 2.0),
                     _span("unasked", 3, 4, 2.0)]
