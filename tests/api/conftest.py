"""`bloompeer api` as a real process, a client of the shared swarm (tests/conftest.py), and
the official `openai` package talking to it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from bloompeer.peer.cli.local_swarm import PeerProcess

START_TIMEOUT_S = 120.0


class ApiProcess:
    """`bloompeer api --port 0 ...`; ready once it printed "api: http://HOST:PORT/v1"."""

    def __init__(self, model: Path, log_dir: Path, *args: str, name: str = "api", env: dict | None = None,
                 wait: bool = True):
        self.process = PeerProcess(name, ["api", "--model", str(model), "--port", "0", *args], log_dir, env)
        if wait:
            self.wait()

    def wait(self) -> ApiProcess:
        """Until it answers (its "api: URL" line)."""
        try:
            self.url = self.process.wait_for_line("api: ", time.monotonic() + START_TIMEOUT_S).split(" ", 1)[1]
        except BaseException:
            self.process.stop()
            raise
        self.base_url = self.url.removesuffix("/v1")
        return self

    def client(self, api_key: str = "not-needed", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=120.0, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key="not-needed", max_retries=0, timeout=120.0)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, str, str]:
        """(status, content type, body) of GET base_url + path, with the standard library's client."""
        return _http(urllib.request.Request(self.base_url + path, headers=headers or {}))

    def post_json(self, path: str, body: dict) -> tuple[int, str, str]:
        return _http(urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(), method="POST",
                                            headers={"Content-Type": "application/json"}))

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM; SIGKILL if it is still running after timeout_s. Its exit code."""
        return self.process.stop(timeout_s)


def _http(request: urllib.request.Request) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def start_api(model: Path, log_dir: Path, *args: str, **kwargs) -> ApiProcess:
    return ApiProcess(model, log_dir, *args, **kwargs)


def start_waiting_api(swarm, model: Path, log_dir: Path, *args: str, **kwargs) -> ApiProcess:
    """An API over the shared swarm that trusts only its first server (blocks 0:2), so that every request
    through the swarm waits, up to ten minutes, for servers of blocks 2:4: work that is in flight for
    as long as a test needs it to be."""
    return start_api(model, log_dir, "--initial-peers", *swarm.initial_peers, "--trusted-servers",
                     swarm.servers[0].peer_id_str, "--timeout", "600", *args, **kwargs)


def scrape(api: ApiProcess) -> dict[tuple[str, tuple], float]:
    """GET /metrics, parsed with prometheus_client's own parser: (sample name, sorted labels) -> value."""
    status, content_type, text = api.get("/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def sample_value(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """One sample of a scrape by name and exact labels; 0 when the series has not been created yet."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def gauge(api: ApiProcess, name: str) -> float:
    """The value of one of the API's gauges, summed over its labels."""
    return sum(value for (sample, _), value in scrape(api).items() if sample == name)


@pytest.fixture(scope="session")
def api(swarm, tiny_checkpoint, tmp_path_factory) -> Iterator[ApiProcess]:
    """The API over the shared swarm's tiny model."""
    process = start_api(tiny_checkpoint, tmp_path_factory.mktemp("api-logs"), "--initial-peers",
                        *swarm.initial_peers)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def client(api) -> Iterator[openai.OpenAI]:
    with api.client() as client:
        yield client


@pytest.fixture(scope="session")
def model_id(tiny_checkpoint) -> str:
    return tiny_checkpoint.name


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint):
    """The tiny model's tokenizer (byte-level), as the API itself loads it."""
    return AutoTokenizer.from_pretrained(tiny_checkpoint)
