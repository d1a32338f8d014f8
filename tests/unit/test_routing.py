import dataclasses

from bloompeer.p2p import RequestLimits, ServerRecord, ServerState
from bloompeer.peer.client.config import ClientConfig
from bloompeer.peer.client.errors import MissingBlocksError, block_ranges
from bloompeer.peer.client.routing import (
    RequestSize, ServerFilter, SpanRoute, choose_plan, choose_push_route, choose_route, missing_blocks,
    refusal_everywhere, usable_servers, why_no_route,
)
from bloompeer.weight_format import WeightFormat


def _record(peer, start, end, state=ServerState.ONLINE, fingerprint="f", throughput=100.0, cache=1000,
            relayed=False, max_length=8192, push_rtts=()):
    return ServerRecord(peer, state, start, end, throughput, cache, WeightFormat(), "0", fingerprint, relayed,
                        RequestLimits(max_batch=64, max_length=max_length, max_step_tokens=4096), tuple(push_rtts))


def _by_block(records, num_blocks=6):
    return {i: [r for r in records if r.start <= i < r.end] for i in range(num_blocks)}


def test_fewer_hops_win_when_servers_are_alike():
    servers = _by_block([_record("a", 0, 3), _record("b", 1, 6), _record("c", 3, 6)])
    route = choose_route(servers, 0, 6, {"a": 0.01, "b": 0.01, "c": 0.01})
    assert len(route) == 2 and route[0].start == 0 and route[-1].end == 6


def test_the_faster_server_wins_and_routes_can_split_anywhere():
    servers = _by_block([_record("slow", 0, 6, throughput=10), _record("fast", 2, 6, throughput=1000),
                         _record("head", 0, 2, throughput=1000)])
    assert choose_route(servers, 0, 6, {"slow": 0.001, "fast": 0.001, "head": 0.001}) == [
        SpanRoute("head", 0, 2), SpanRoute("fast", 2, 6)]


def test_round_trip_time_counts():
    servers = _by_block([_record("far", 0, 6), _record("near", 0, 6)])
    assert choose_route(servers, 0, 6, {"far": 0.5, "near": 0.001}) == [SpanRoute("near", 0, 6)]
    assert choose_route(servers, 0, 6, {"far": 0.001, "near": 0.5}) == [SpanRoute("far", 0, 6)]


def test_banned_full_and_relayed_servers():
    servers = _by_block([_record("a", 0, 6), _record("b", 0, 6, cache=10), _record("r", 0, 6, relayed=True)])
    rtts = {"a": 0.001, "b": 0.001, "r": 0.001}
    assert choose_route(servers, 0, 6, rtts) == [SpanRoute("a", 0, 6)]  # relayed costs more
    assert choose_route(servers, 0, 6, rtts, exclude={"a"}) == [SpanRoute("b", 0, 6)]
    assert choose_route(servers, 0, 6, rtts, exclude={"a"}, min_cache_tokens=100) == [SpanRoute("r", 0, 6)]
    assert choose_route(servers, 0, 6, rtts, exclude={"a", "r"}, min_cache_tokens=100) is None


def test_a_sub_range_and_a_gap():
    servers = _by_block([_record("a", 0, 2), _record("b", 4, 6)])
    assert choose_route(servers, 4, 6) == [SpanRoute("b", 4, 6)]
    assert choose_route(servers, 0, 6) is None
    assert missing_blocks(servers, 0, 6) == [2, 3]
    assert missing_blocks(servers, 0, 6, exclude={"b"}) == [2, 3, 4, 5]


def test_unusable_servers_are_dropped():
    records = [_record("a", 0, 2), _record("b", 2, 4, ServerState.DRAINING), _record("c", 2, 4, fingerprint="other")]
    servers = usable_servers(_by_block(records, 4), ServerFilter("f"))
    assert missing_blocks(servers, 0, 4) == [2, 3]


def test_servers_storing_weights_in_a_way_the_client_refuses_are_dropped():
    records = [_record("float", 0, 4), dataclasses.replace(_record("int8", 0, 4), weights=WeightFormat("int8")),
               dataclasses.replace(_record("int4", 2, 4), weights=WeightFormat("int4", 64))]
    everyone = _by_block(records, 4)
    assert usable_servers(everyone, ServerFilter("f")) == everyone
    only_float = usable_servers(everyone, ServerFilter("f", quant=frozenset({"none"})))
    assert {r.peer_id for records in only_float.values() for r in records} == {"float"}
    assert choose_route(usable_servers(everyone, ServerFilter("f", quant=frozenset({"int4"}))), 0, 4) is None
    assert missing_blocks(usable_servers(everyone, ServerFilter("f", quant=frozenset({"int8", "int4"}))), 0, 4) == []


def test_an_exact_client_uses_only_unquantized_servers_computing_in_its_dtype():
    records = [_record("float32", 0, 4), dataclasses.replace(_record("bfloat16", 0, 4),
                                                             weights=WeightFormat(dtype="bfloat16")),
               dataclasses.replace(_record("int8", 0, 4), weights=WeightFormat("int8"))]
    exact = ServerFilter.of_client(ClientConfig(quant_allowed=("none",)), "f", "float32")
    assert {r.peer_id for r in usable_servers(_by_block(records, 4), exact)[0]} == {"float32"}
    assert why_no_route(_by_block(records[1:], 4), 0, 4, exact) == (
        "block 0 is announced by ...bfloat16 (computes in bfloat16, and this client asks for exact float32 results); "
        "...int8 (weights stored as int8, which this client does not allow)")
    for inexact in (ClientConfig(), ClientConfig(quant_allowed=("none", "int8"))):
        assert usable_servers(_by_block(records, 4), ServerFilter.of_client(inexact, "f", "float32"))[0] == records


def test_why_no_route_names_each_server_of_the_first_unserved_block_and_what_it_lacks():
    announced = _by_block([_record("full-server", 0, 2, cache=3), _record("other-weights", 0, 2, fingerprint="g"),
                           _record("leaving-server", 0, 2, state=ServerState.DRAINING),
                           _record("failed-server", 0, 2), _record("ok-server", 2, 4)], 4)
    anyone = ServerFilter("f")
    seen = why_no_route(announced, 0, 4, anyone, banned={"failed-server"}, min_cache_tokens=16)
    assert seen.startswith("block 0 is announced by ")
    for reason in ("...l-server (3 cache tokens left of the 16 needed)", "...-weights (other weights",
                   "...g-server (draining, not online)", "...d-server (not used for now after failing)"):
        assert reason in seen
    assert why_no_route(announced, 2, 4, anyone, min_cache_tokens=16) == "their servers do not join up into one chain"
    assert why_no_route(_by_block([_record("a", 0, 2)], 4), 0, 4, anyone) == "no server announces block 2"


def test_missing_blocks_message_names_ranges():
    assert block_ranges([0, 1, 2, 5, 7, 8]) == "0:3, 5:6, 7:9"
    message = str(MissingBlocksError("bloom", [2, 3], 5.0, "timed out"))
    assert "2:4" in message and "bloompeer serve" in message and "timed out" in message


def test_servers_whose_limits_a_request_exceeds_are_never_chosen():
    servers = _by_block([_record("short", 0, 6, max_length=64), _record("long", 0, 6, max_length=512)])
    rtts = {"short": 0.001, "long": 0.5}  # the short one is much nearer
    assert choose_route(servers, 0, 6, rtts) == [SpanRoute("short", 0, 6)]
    assert choose_route(servers, 0, 6, rtts, request=RequestSize(1, 200, 20)) == [SpanRoute("long", 0, 6)]
    assert refusal_everywhere(servers, 0, 6, RequestSize(1, 200, 20)) is None


def test_a_request_over_every_servers_limit_is_named_with_the_largest_on_offer():
    servers = _by_block([_record("a", 0, 3, max_length=64), _record("b", 0, 6, max_length=128),
                         _record("c", 3, 6, max_length=1024)])
    reason = refusal_everywhere(servers, 0, 6, RequestSize(1, 200, 20))
    assert reason.startswith("tokens per session (prompt and new tokens) 200 is over the limit of every server of block 0")
    assert "largest on offer is 128" in reason and "--max-length" in reason
    assert refusal_everywhere(servers, 3, 6, RequestSize(1, 200, 20)) is None
    assert "--max-batch" in refusal_everywhere(servers, 0, 6, RequestSize(65, 10, 650))
    assert "--max-step-tokens" in refusal_everywhere(servers, 3, 6, RequestSize(1, 100, 5000))


def test_pushed_chains_go_through_servers_near_each_other():
    """Two ways through: head -> near (0.01 s apart) or head -> far (0.4 s apart), the client
    equally near all three. Without push the two are alike; with push the servers' announced
    round trips decide, whichever of the pair announced it."""
    rtts = {"head": 0.1, "near": 0.1, "far": 0.1}
    for near_announced_by_head in (True, False):
        head = _record("head", 0, 3, push_rtts=[("far", 0.4)] + ([("near", 0.01)] if near_announced_by_head else []))
        near = _record("near", 3, 6, push_rtts=[] if near_announced_by_head else [("head", 0.01)])
        servers = _by_block([head, near, _record("far", 3, 6, throughput=1000)])
        assert choose_route(servers, 0, 6, rtts)[1].peer_id_str == "far"  # a little faster at compute
        assert choose_push_route(servers, 0, 6, rtts) == [SpanRoute("head", 0, 3), SpanRoute("near", 3, 6)]


def test_the_client_pushes_where_it_saves_enough():
    servers = _by_block([_record("a", 0, 2, throughput=1e6, push_rtts=[("b", 0.1)]),
                         _record("b", 2, 4, throughput=1e6, push_rtts=[("c", 0.1)]),
                         _record("c", 4, 6, throughput=1e6)])
    far = {"a": 0.1, "b": 0.1, "c": 0.1}  # 50 ms each way everywhere: 0.3 s a step unpushed, 0.2 s pushed
    plan = choose_plan(servers, 0, 6, far, push=None)
    assert plan.push and [r.peer_id_str for r in plan.route] == ["a", "b", "c"]
    assert abs(plan.cost_s - 0.2) < 0.01
    assert not choose_plan(servers, 0, 6, far, push=False).push
    loopback = _by_block([_record(r.peer_id, r.start, r.end, throughput=1e6, push_rtts=[(p, 0.0005) for p, _ in
                                                                                      r.push_rtts_s])
                          for r in {r.peer_id: r for rs in servers.values() for r in rs}.values()])
    near = {"a": 0.0005, "b": 0.0005, "c": 0.0005}
    assert not choose_plan(loopback, 0, 6, near, push=None).push  # saves well under a millisecond
    assert choose_plan(loopback, 0, 6, near, push=True).push  # asked for
    one_server = _by_block([_record("all", 0, 6)])
    assert not choose_plan(one_server, 0, 6, {"all": 0.1}, push=None).push  # nothing to push to
    assert choose_plan(_by_block([]), 0, 6, far, push=None) is None


def test_unknown_round_trips_between_servers_count_as_far():
    """Servers that announced nothing yet (just started) are assumed UNKNOWN_RTT_S apart: no push
    on a guess between nearby machines."""
    servers = _by_block([_record("a", 0, 3, throughput=1e6), _record("b", 3, 6, throughput=1e6)])
    assert not choose_plan(servers, 0, 6, {"a": 0.001, "b": 0.001}, push=None).push
