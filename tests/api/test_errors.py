"""Errors in OpenAI's shape, as the openai client raises them: 400 invalid parameters (also over
the swarm's limits, named), 404 unknown model, 503 naming the blocks nobody serves."""

from __future__ import annotations

import json
import time

import openai
import pytest

from .conftest import start_api


def _error(raised) -> dict:
    return raised.value.body if "message" in raised.value.body else raised.value.body["error"]


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert raised.value.status_code == 404
    assert _error(raised)["code"] == "model_not_found" and "gpt-4" in _error(raised)["message"]


@pytest.mark.parametrize("parameters, param", [
    ({"temperature": 5.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"n": 129}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["one", 2]}, "prompt"),
    ({"suffix": "after"}, "suffix"),
    ({"prompt": [1, 99999999]}, "prompt"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"frequency_penalty": 2.1}, "frequency_penalty"),
])
def test_invalid_parameters_are_400_naming_them(client, model_id, parameters, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**{"model": model_id, "prompt": "x", "max_tokens": 2, **parameters})
    assert raised.value.status_code == 400
    error = _error(raised)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_a_request_over_the_swarms_limits_is_400_naming_the_limit(client, model_id):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_id, prompt="x", max_tokens=9000, temperature=0)
    error = _error(raised)
    assert error["code"] == "over_swarm_limits"
    assert "tokens per session" in error["message"] and "8192" in error["message"] \
        and "--max-length" in error["message"], error
    with pytest.raises(openai.BadRequestError):  # a stream is refused before it starts
        client.completions.create(model=model_id, prompt="x", max_tokens=9000, stream=True)


@pytest.fixture
def half_served_api(start_servers, fresh_model, swarm, tmp_path):
    """An API for a model whose blocks 2:4 nobody serves, answering 503 after 1 s of waiting; yielded
    once its view of the swarm has the server of 0:2 (a lookup may miss a record a server just stored,
    and the API reads the DHT again every 10 s: asked until it has, for up to 120 s, a guard)."""
    start_servers([(0, 2)])
    api = start_api(fresh_model, tmp_path, "--timeout", "1", "--initial-peers", *swarm.initial_peers,
                    name="api-half-served")
    try:
        deadline = time.monotonic() + 120
        while json.loads(api.get("/health")[2]).get("missing_blocks") != [2, 3] and time.monotonic() < deadline:
            time.sleep(0.25)  # polling what the API reports, not waiting for it to happen
        yield api
    finally:
        api.stop()


def test_missing_blocks_are_503_naming_them(half_served_api, fresh_model):
    with half_served_api.client() as client:
        models = client.models.list().data
        assert models[0].model_extra["all_blocks_covered"] is False
        assert models[0].model_extra["missing_blocks"] == [2, 3]
        status, _, body = half_served_api.get("/health")  # a readiness probe sees it at once, with no waiting
        assert status == 503 and json.loads(body)["missing_blocks"] == [2, 3]
        assert json.loads(body)["status"] == "unavailable"
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as raised:
                client.completions.create(model=fresh_model.name, prompt="x", max_tokens=4, stream=stream)
            assert raised.value.status_code == 503
            error = _error(raised)
            assert error["code"] == "missing_blocks" and error["missing_blocks"] == [2, 3]
            assert "block(s) 2:4" in error["message"] and "bloompeer serve" in error["message"], error


def test_an_image_in_a_chat_message_is_400_naming_the_part(client, model_id):
    """The API serves text models (a multimodal checkpoint's text model): an image part is refused, not dropped."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    error = _error(raised)
    assert error["param"] == "messages.0.content", error
    assert "content part 1" in error["message"] and "'image_url'" in error["message"] \
        and "only text parts" in error["message"], error
