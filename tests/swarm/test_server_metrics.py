"""`serve --metrics-port`: a real server's /metrics, scraped over HTTP and parsed with prometheus_client's
own parser, counts what a generation made it compute and the error codes of bad requests."""

import asyncio
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from bloompeer.p2p import ErrorCode, NetworkConfig, OpenSession, PeerNode, read_frame, write_frame
from bloompeer.peer.server.step_clock import PHASES
from tests.wire import raw_stream

from .conftest import swarm_client

PROMPT = torch.tensor([[1, 60, 61, 62, 63, 64, 65]])
NEW_TOKENS = 9


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}; also checks the names follow the conventions."""
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("bloompeer_"):
            continue  # none expected (a registry of the server's own), but not this test's concern
        assert family.name.startswith("bloompeer_server_")
        for sample in family.samples:
            if family.type == "counter" and not sample.name.endswith("_created"):
                assert sample.name.endswith("_total"), sample.name
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout_s:.0f} s"
        time.sleep(0.05)
    return result


@pytest.fixture
def metered_server(start_servers):
    """One server of every block of a model of its own, with metrics on a free port; and its URL."""
    (server,) = start_servers([(0, 4)], "--metrics-port", "0", "--max-length", "256")
    line = next((line for line in server.stdout if line.startswith("metrics: ")), None)
    assert line is not None, f"the server printed no 'metrics: URL' line before 'online':\n{server.stdout}"
    url = line.split(" ", 1)[1]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")  # loopback unless told otherwise
    return server, url


@torch.inference_mode()
def test_metrics_count_a_generation(metered_server, swarm, fresh_model, reference_model):
    server, url = metered_server
    before = scrape(url)
    assert value(before, "bloompeer_server_open_sessions") == 0
    free_before = value(before, "bloompeer_server_cache_tokens_free")
    assert free_before > 0 and value(before, "bloompeer_server_cache_tokens_used") == 0
    with swarm_client(swarm, fresh_model) as model:
        with model.inference_session(max_length=64):
            ours = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
            during = scrape(url)
    assert ours.tolist() == reference_model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    assert value(during, "bloompeer_server_open_sessions") == 1
    assert value(during, "bloompeer_server_cache_tokens_used") == 64
    per_token = value(during, "bloompeer_server_cache_bytes_used") / 64  # 4 blocks' keys and values, the mask's byte
    assert per_token == 4 * 2 * 64 * 4 + 1
    assert value(during, "bloompeer_server_cache_tokens_free") == free_before - 64

    def closed():
        samples = scrape(url)
        return samples if value(samples, "bloompeer_server_open_sessions") == 0 else None

    after = wait_for(closed, "the session closed on the server")
    assert value(after, "bloompeer_server_cache_tokens_free") == free_before
    assert value(after, "bloompeer_server_queue_depth") == 0
    # the prompt, then one step per generated token but the last: at least the tokens generated
    computed = (value(after, "bloompeer_server_tokens_total", kind="inference")
                - value(before, "bloompeer_server_tokens_total", kind="inference"))
    assert computed >= PROMPT.shape[1] + NEW_TOKENS - 1 >= NEW_TOKENS
    steps = (value(after, "bloompeer_server_requests_total", kind="step", code="ok")
             - value(before, "bloompeer_server_requests_total", kind="step", code="ok"))
    assert steps >= NEW_TOKENS - 1
    assert value(after, "bloompeer_server_requests_total", kind="open", code="ok") >= 1
    latencies = (value(after, "bloompeer_server_step_latency_seconds_count")
                 - value(before, "bloompeer_server_step_latency_seconds_count"))
    assert latencies == steps and value(after, "bloompeer_server_step_latency_seconds_sum") > 0
    phases = {phase: (value(after, "bloompeer_server_step_phase_seconds_count", phase=phase)
                      - value(before, "bloompeer_server_step_phase_seconds_count", phase=phase),
                      value(after, "bloompeer_server_step_phase_seconds_sum", phase=phase)
                      - value(before, "bloompeer_server_step_phase_seconds_sum", phase=phase)) for phase in PHASES}
    assert all(count == steps for count, _ in phases.values()), phases  # each step is observed in every phase
    assert all(seconds >= 0 for _, seconds in phases.values()) and phases["compute"][1] > 0, phases
    until_output = sum(phases[phase][1] for phase in ("decode", "queue", "compute", "resume"))
    latency = (value(after, "bloompeer_server_step_latency_seconds_sum")
               - value(before, "bloompeer_server_step_latency_seconds_sum"))
    assert until_output <= latency + 1e-6 * steps, (phases, latency)  # parts of the same stretch of time
    passes = (value(after, "bloompeer_server_batch_size_count") - value(before, "bloompeer_server_batch_size_count"))
    assert passes >= steps  # one session alone: one pass per step (the prompt may take more)
    assert value(after, "bloompeer_server_batch_size_bucket", le="1.0") >= passes


async def _bad_requests(swarm, server, model_uid: str) -> list[dict]:
    """A step before any open, then an open over the server's max_length: the error frames."""
    node = await PeerNode.create(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True))
    try:
        reader, writer = await raw_stream(node, server)
        await write_frame(writer, {"type": "step", "position": 0})
        replies = [await asyncio.wait_for(read_frame(reader), 30)]
        await write_frame(writer, OpenSession(model_uid, 0, 4, 1, 100_000, 0.0).to_wire())
        replies.append(await asyncio.wait_for(read_frame(reader), 30))
        writer.close()
        return replies
    finally:
        await node.shutdown()


def test_metrics_count_errors_by_code(metered_server, swarm, fresh_model):
    server, url = metered_server
    before = scrape(url)
    replies = asyncio.run(_bad_requests(swarm, server, fresh_model.name))
    assert [reply.get("code") for reply in replies] == [ErrorCode.BAD_REQUEST.value, ErrorCode.TOO_LARGE.value]
    after = scrape(url)
    for kind, code in (("step", "bad_request"), ("open", "too_large")):
        counted = (value(after, "bloompeer_server_requests_total", kind=kind, code=code)
                   - value(before, "bloompeer_server_requests_total", kind=kind, code=code))
        assert counted == 1, (kind, code)
    assert value(after, "bloompeer_server_requests_total", kind="open", code="ok") == value(
        before, "bloompeer_server_requests_total", kind="open", code="ok")


def test_serve_help_describes_the_metrics_flags():
    result = subprocess.run([sys.executable, "-m", "bloompeer", "serve", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "--metrics-port PORT" in text and "/metrics" in text and "--metrics-host" in text


def test_a_metrics_port_in_use_is_explained(swarm, fresh_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "bloompeer", "serve", "--model", str(fresh_model), "--blocks", "0:4",
             "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--no-relay", "--initial-peers", *swarm.initial_peers,
             "--metrics-port", str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"could not serve metrics on 127.0.0.1:{port}" in result.stderr and "--metrics-port" in result.stderr
    assert "Traceback" not in result.stderr and "online" not in result.stdout
