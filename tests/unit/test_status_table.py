"""`bloompeer status`'s table on fake records: a server moving to other blocks shows both spans."""

from bloompeer.blocks import open_checkpoint
from bloompeer.p2p import RequestLimits, ServerRecord, ServerState
from bloompeer.peer.cli.status_command import format_status
from bloompeer.peer.swarm_status import describe_experts, status_data, weights_on_offer
from bloompeer.weight_format import WeightFormat


def _record(peer, start, end, state, weights=WeightFormat()):
    return ServerRecord(peer, state, start, end, 5.0, 100, weights, "0", "f", False, RequestLimits(1, 1, 1))


def test_a_moving_server_has_a_row_for_each_span():
    mover = "Qm" + "m" * 44
    other = "Qm" + "o" * 44
    records = [_record(mover, 0, 2, ServerState.DRAINING), _record(mover, 2, 4, ServerState.JOINING),
               _record(other, 0, 2, ServerState.ONLINE)]
    servers = {i: [r for r in records if r.start <= i < r.end] for i in range(4)}
    table = format_status("m", 4, servers).splitlines()
    assert "  block    2  MISSING (…mmmmmmmm joining)" in table
    rows = [line.split() for line in table if line.startswith("  …")]
    assert rows == [["…mmmmmmmm", "0:2", "draining", "float32", "5.0", "100", "direct"],
                    ["…oooooooo", "0:2", "online", "float32", "5.0", "100", "direct"],
                    ["…mmmmmmmm", "2:4", "joining", "float32", "5.0", "100", "direct"]]


def test_the_weights_column_says_how_each_server_stores_them():
    records = [_record("Qm" + "a" * 44, 0, 4, ServerState.ONLINE),
               _record("Qm" + "b" * 44, 0, 4, ServerState.ONLINE, WeightFormat("int8")),
               _record("Qm" + "c" * 44, 0, 4, ServerState.ONLINE, WeightFormat("int4", 64)),
               _record("Qm" + "d" * 44, 0, 4, ServerState.JOINING, WeightFormat("int4", 32))]
    servers = {i: records for i in range(4)}
    rows = [line.split() for line in format_status("m", 4, servers).splitlines() if line.startswith("  …")]
    assert [row[3] for row in rows] == ["float32", "int8", "int4/64", "int4/32"]
    data = status_data("m", 4, servers)
    assert [server["weights"] for server in data["blocks"][0]["servers"]] == ["float32", "int8", "int4/64", "int4/32"]
    assert weights_on_offer(servers) == data["weights"] == ["float32", "int4/64", "int8"]  # online servers only


def test_a_mixture_of_experts_says_how_many_experts_a_block_has_and_a_token_uses(moe_checkpoints):
    """From the checkpoint's config through its family (BlockSpan.experts_of): Qwen3-MoE's block 1 is dense."""
    checkpoint = open_checkpoint(moe_checkpoints["qwen3_moe"])
    config = checkpoint.config()
    experts = checkpoint.family.span_class.experts_of(config)
    assert experts == ((8, 3), (0, 0), (8, 3), (8, 3))
    servers = {i: [_record("Qm" + "a" * 44, 0, 4, ServerState.ONLINE)] for i in range(4)}
    header = format_status("m", 4, servers, experts).splitlines()[0]
    assert header == "m (bloom family): 4 blocks; 8 experts a block, 3 used a token; dense: block 1"  # as records say
    data = status_data("m", 4, servers, experts)
    assert [(block["experts"], block["experts_per_token"]) for block in data["blocks"]] == list(experts)
    assert describe_experts(((0, 0),) * 4) is None and format_status("m", 4, servers).splitlines()[0] == \
        "m (bloom family): 4 blocks"
