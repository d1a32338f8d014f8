"""API keys (`bloompeer api --api-key KEY`, repeatable, or $BLOOMPEER_API_KEY): /v1 needs one, as the
openai client sends it, else 401 in OpenAI's shape; the dashboard and /metrics too, unless
--public-dashboard; /health never (checked with a real HTTP client); an open bind without a key is
warned about."""

from __future__ import annotations

import base64
import json
import logging
import urllib.error
import urllib.request

import openai
import pytest

from bloompeer.peer.api.auth import ApiAccess, is_loopback
from bloompeer.peer.cli import api_command

from .conftest import start_api

KEYS = ("first-key", "second-key")
ENV_KEY = "key-from-the-environment"


@pytest.fixture(scope="module")
def keyed_apis(swarm, tiny_checkpoint, tmp_path_factory):
    """Two APIs on the shared swarm, started at once: keys from flags; a key from the environment
    with a public dashboard."""
    log_dir = tmp_path_factory.mktemp("auth-logs")
    peers = ("--initial-peers", *swarm.initial_peers)
    started = [start_api(tiny_checkpoint, log_dir, *peers, "--api-key", KEYS[0], "--api-key", KEYS[1],
                         name="api-keys", wait=False),
               start_api(tiny_checkpoint, log_dir, *peers, "--public-dashboard", name="api-public",
                         env={"BLOOMPEER_API_KEY": ENV_KEY}, wait=False)]
    try:
        yield [api.wait() for api in started]
    finally:
        for api in started:
            api.stop()


def _get(url: str, authorization: str | None = None) -> tuple[int, dict]:
    """(status, headers) of a GET with the standard library's HTTP client."""
    request = urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _complete(api, model_id, key):
    with api.client(api_key=key) as client:
        return client.completions.create(model=model_id, prompt="Keys", max_tokens=3, temperature=0).choices[0].text


def test_every_key_works_and_nothing_else_does(keyed_apis, model_id):
    api, _ = keyed_apis
    assert _complete(api, model_id, KEYS[0]) == _complete(api, model_id, KEYS[1])
    for wrong in ("not-a-key", KEYS[0] + "x", ENV_KEY):
        with pytest.raises(openai.AuthenticationError) as raised:
            _complete(api, model_id, wrong)
        assert raised.value.status_code == 401
        error = raised.value.body if "message" in raised.value.body else raised.value.body["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert "--api-key" in error["message"]
    with api.client(api_key=KEYS[0]) as client:  # streams and the model list too
        assert [model.id for model in client.models.list().data] == [model_id]
        assert list(client.completions.create(model=model_id, prompt="Keys", max_tokens=2, stream=True))
    status, _, body = api.post_json("/v1/completions", {"model": model_id, "prompt": "x"})  # no header at all
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert "didn't provide" in json.loads(body)["error"]["message"]


def test_the_dashboard_and_metrics_need_the_key_unless_public(keyed_apis, model_id):
    private, public = keyed_apis
    for path in ("/", "/api/swarm", "/metrics"):
        status, headers = _get(private.base_url + path)
        assert status == 401, path
        assert headers["www-authenticate"].startswith("Basic")  # a browser asks for the key
        assert _get(private.base_url + path, f"Bearer {KEYS[1]}")[0] == 200
        assert _get(private.base_url + path, _basic("anyone", KEYS[0]))[0] == 200  # as a browser sends it
        assert _get(private.base_url + path, _basic("anyone", "wrong"))[0] == 401
        assert _get(public.base_url + path)[0] == 200, path
    assert _complete(public, model_id, ENV_KEY)
    with pytest.raises(openai.AuthenticationError):
        _complete(public, model_id, KEYS[0])
    assert _get(public.base_url + "/v1/models")[0] == 401
    for api in keyed_apis:  # a probe holds no key
        assert _get(api.base_url + "/health")[0] == 200


def test_an_open_bind_without_a_key_is_warned_about(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.7") and not is_loopback("example.org")
    with caplog.at_level(logging.WARNING, logger=api_command.__name__):
        api_command._warn_if_open("127.0.0.1", ApiAccess())
        api_command._warn_if_open("0.0.0.0", ApiAccess(keys=frozenset({"k"})))
        assert not caplog.records
        api_command._warn_if_open("0.0.0.0", ApiAccess())
    assert len(caplog.records) == 1 and "--api-key" in caplog.records[0].getMessage()
