"""Servers with quantized weights (`serve --quant`) in a swarm with float ones: a client that allows
only float weights (an exact client) never touches them, nor a bfloat16 server; verification
compares int8 servers only with each other and still catches a lying one, gradients through an int8
server stay close to float32's, and a server's RSS stays within its memory plan for none, int8 and
int4.

One swarm of the module's own (on the shared bootstrap peer), started at once: a float32 server, a
bfloat16 one, an honest int8 one and a lying int8 one (the bfloat16 and lying ones announced fastest,
so a client would pick them) of the tiny BLOOM; and one server per --quant of a Qwen3-shaped
checkpoint of hidden 1024 for the memory test.
"""

import asyncio
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from bloompeer.p2p import INFERENCE_PROTOCOL, CloseSession, NetworkConfig, OpenSession, PeerNode, Step, read_frame
from bloompeer.p2p import write_frame
from bloompeer.peer.cli.default_model import write_random_checkpoint
from bloompeer.peer.cli.local_swarm import BLOOMPEER_COMMAND, stop_in_parallel
from bloompeer.peer.client.verification import relative_error
from tests.wire import raw_stream

from .conftest import swarm_client
from .test_server_memory import rss_mib
from .test_server_metrics import scrape, value
from .test_trust import FAST, LIAR, PROMPT, SLOW, _blamed, _expected, _generate, _seeing, _view

KINDS = ("none", "int8", "int4")
MEMORY_HIDDEN, MEMORY_BLOCKS = 1024, 4
SESSIONS, MAX_LENGTH, PREFILL = 4, 512, 16
RSS_FACTOR = 1.15


@pytest.fixture(scope="module")
def memory_checkpoint(tmp_path_factory) -> Path:
    """A Qwen3 shape (16 heads, 8 kv heads, intermediate 3 x hidden) whose weights (about 50 MiB a block
    in float32) weigh against the process's fixed overhead: a kept float copy would show."""
    return write_random_checkpoint(tmp_path_factory.mktemp("qwen3-h1024"), model_type="qwen3",
                                   num_blocks=MEMORY_BLOCKS, hidden_size=MEMORY_HIDDEN, num_heads=16,
                                   head_dim=64, max_shard_size="60MB")


@pytest.fixture(scope="module")
def quantized_swarm(swarm, tiny_checkpoint, memory_checkpoint, tmp_path_factory):
    """{"model": the tiny model's path, "float", "bfloat16", "int8", "liar": its servers, "memory": {kind: server}}."""
    model = tmp_path_factory.mktemp("quantized") / "tiny-quantized"
    shutil.copytree(tiny_checkpoint, model)
    metrics = ("--metrics-port", "0")

    def start(name, *args, program=None, checkpoint=model):
        return swarm.add_server(0, 4, extra_args=args, wait=False, name=name, model=checkpoint, program=program)

    servers = {"float": start("tiny-float", *SLOW, *metrics),
               "bfloat16": start("tiny-bfloat16", "--dtype", "bfloat16", *FAST, *metrics),
               "int8": start("tiny-int8", "--quant", "int8", *SLOW, *metrics),
               "liar": start("tiny-int8-liar", "--quant", "int8", *FAST, *metrics, program=LIAR)}
    # new interpreters, not forks (tests/conftest.py): a fork's RSS would count pages of its fork server's
    memory = {kind: start(f"memory-{kind}", "--quant", kind, "--throughput", "1", "--cache-tokens",
                          str(SESSIONS * MAX_LENGTH), "--max-length", str(MAX_LENGTH), checkpoint=memory_checkpoint,
                          program=BLOOMPEER_COMMAND)
              for kind in KINDS}
    try:
        deadline = time.monotonic() + 240
        for server in [*servers.values(), *memory.values()]:
            server.wait_online(deadline)
        yield {"model": model, **servers, "memory": memory}
    finally:
        stop_in_parallel([*servers.values(), *memory.values()])


def _metrics_url(server) -> str:
    return next(line for line in server.stdout if line.startswith("metrics: ")).split(" ", 1)[1]


def _inference_requests(server) -> float:
    samples = scrape(_metrics_url(server))
    return sum(value(samples, "bloompeer_server_requests_total", kind=kind, code="ok")
               for kind in ("open", "step", "forward", "push"))


def test_a_client_allowing_only_float_weights_never_touches_an_int8_or_bfloat16_server(swarm, quantized_swarm,
                                                                                        reference_model):
    servers = quantized_swarm
    before = {name: _inference_requests(servers[name]) for name in ("float", "bfloat16", "int8", "liar")}
    with swarm_client(swarm, servers["model"], quant_allowed=("none",)) as model:
        with model.inference_session(max_length=32) as session:
            tokens = _generate(model)
            assert [piece.peer_id_str for piece in session.route] == [servers["float"].peer_id_str]
    assert tokens.tolist() == _expected(reference_model).tolist()  # float weights: transformers' tokens
    after = {name: _inference_requests(servers[name]) for name in before}
    assert after["float"] > before["float"]
    assert all(after[name] == before[name] for name in ("bfloat16", "int8", "liar"))


def test_verification_compares_int8_servers_with_each_other_and_bans_only_the_liar(swarm, quantized_swarm):
    servers = quantized_swarm
    honest, liar = servers["int8"].peer_id_str, servers["liar"].peer_id_str
    with swarm_client(swarm, servers["model"], quant_allowed=("int8",), trusted_servers=(honest,)) as model:
        expected = _generate(model)  # the honest int8 server alone
    with swarm_client(swarm, servers["model"], quant_allowed=("int8",), verify_fraction=1.0,
                      request_timeout_s=30.0) as model:
        _seeing(model, servers["int8"], servers["liar"])
        tokens = _generate(model)
        assert _blamed(model) == {liar}, _view(model)
    assert tokens.tolist() == expected.tolist()
    # every kind allowed, every step checked: the float server and the honest int8 one are each
    # compared with their own kind (the client's own blocks, quantized alike), never with each other
    with swarm_client(swarm, servers["model"], verify_fraction=1.0, request_timeout_s=30.0,
                      trusted_servers=(honest, servers["float"].peer_id_str)) as model:
        _generate(model)
        assert _blamed(model) == set()


def test_fine_tuning_gradients_through_an_int8_server_are_close_to_float32s(swarm, quantized_swarm):
    servers = quantized_swarm
    grads = {}
    for kind, server in (("none", servers["float"]), ("int8", servers["int8"])):
        torch.manual_seed(0)  # the same prompts' initial values, the same ids
        with swarm_client(swarm, servers["model"], quant_allowed=(kind,), trusted_servers=(server.peer_id_str,),
                          tuning_mode="ptune", pre_seq_len=2) as model:
            ids = torch.randint(10, 250, (2, 6))
            embeds = model.transformer.word_embeddings(ids).detach().requires_grad_()
            model(inputs_embeds=embeds, labels=ids).loss.backward()
            grads[kind] = embeds.grad, model.transformer.prompt_embeddings.weight.grad
    for ours, float32s in zip(grads["int8"], grads["none"]):
        assert float32s.abs().max() > 0
        error = relative_error(ours, float32s)
        print(f"int8 gradient's relative error to float32's: {error:.2e}")
        assert 0 < error < 0.05  # not float's own (the int8 server computed it), but close


async def _hold_sessions(server, model_uid: str, peers: list[str]) -> list[tuple]:
    """Open SESSIONS sessions of MAX_LENGTH on `server`, step each (a prefill, then 2 tokens, batched), and
    return the open streams (their cache stays reserved until closed)."""
    node = await PeerNode.create(NetworkConfig(initial_peers=tuple(peers), client_mode=True))
    streams = []
    generator = torch.Generator().manual_seed(0)
    for _ in range(SESSIONS):
        reader, writer = await raw_stream(node, server, INFERENCE_PROTOCOL)
        await write_frame(writer, OpenSession(model_uid, 0, MEMORY_BLOCKS, 1, MAX_LENGTH, 60.0).to_wire())
        assert (await asyncio.wait_for(read_frame(reader), 120))["type"] == "ready"
        streams.append((reader, writer))
    for step_id, num_new in enumerate([PREFILL, 1, 1], 1):
        position = 0 if step_id == 1 else PREFILL + step_id - 2
        for reader, writer in streams:
            hidden = torch.randn(1, num_new, MEMORY_HIDDEN, generator=generator)
            await write_frame(writer, Step(position, hidden, step_id=step_id).to_wire())
        for reader, _ in streams:
            assert (await asyncio.wait_for(read_frame(reader), 120))["type"] == "output"
    return node, streams


async def _close(node, streams) -> None:
    for _, writer in streams:
        await write_frame(writer, CloseSession().to_wire())
        writer.close()
    await node.shutdown()


def _plan_mib(server) -> dict[str, float]:
    """The memory plan the server logged before loading: weights and fixed overhead, in MiB."""
    line = next(line for line in server.log_path.read_text().splitlines() if "Memory plan:" in line)
    weights = float(re.search(r"blocks ([\d.]+) MiB as", line).group(1))
    fixed = float(re.search(r"fixed overhead ([\d.]+) MiB", line).group(1))
    return {"weights": weights, "fixed": fixed}


def test_a_servers_rss_stays_within_its_memory_plan_for_each_quant(swarm, quantized_swarm, memory_checkpoint):
    """RSS <= 1.15 x (weights as stored + cache in use + fixed overhead), with SESSIONS sessions
    open and stepped: for none, that also says batched passes keep no second copy of the weights
    (another 200 MiB here); for int8 and int4, that no float weights stayed behind."""
    cache_mib = SESSIONS * MAX_LENGTH * MEMORY_BLOCKS * 2 * 8 * 64 * 4 / 2**20  # keys and values, 8 kv heads of 64
    rows = {}

    async def measure(kind):
        server = quantized_swarm["memory"][kind]
        node, streams = await _hold_sessions(server, memory_checkpoint.name, swarm.initial_peers)
        try:
            rows[kind] = rss_mib(server.pid), _plan_mib(server)
        finally:
            await _close(node, streams)

    async def measure_all():
        await asyncio.gather(*(measure(kind) for kind in KINDS))

    asyncio.run(measure_all())
    for kind in KINDS:
        rss, plan = rows[kind]
        bound = RSS_FACTOR * (plan["weights"] + cache_mib + plan["fixed"])
        print(f"--quant {kind}: RSS {rss:.1f} MiB, plan: weights {plan['weights']:.1f} + cache in use "
              f"{cache_mib:.1f} + fixed {plan['fixed']:.1f} MiB; bound {bound:.1f} MiB", file=sys.stderr)
        assert rss <= bound, (kind, rss, plan)
    assert rows["int8"][1]["weights"] < 0.3 * rows["none"][1]["weights"]
    assert rows["int4"][1]["weights"] < 0.2 * rows["none"][1]["weights"]
    assert rows["int4"][0] < rows["int8"][0] < rows["none"][0] - 0.5 * rows["none"][1]["weights"]

