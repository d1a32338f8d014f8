"""response_format (json_object, json_schema with and without strict) through the official openai
client against `bloompeer api` over the shared swarm: every reply parses and validates, streamed or
not, with n choices; greedy constrained decoding equals transformers' generate on the same weights
under llguidance's own mask; `.parse()` gives a pydantic object; a schema the library refuses is a
400 naming what it refused.

The tiny model has random weights, so a string or number with no bound would run on to max_tokens:
the schemas bound every value (maxLength, minimum/maximum, enums), as a test of the guarantee must."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import llguidance
import llguidance.hf
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from transformers import LogitsProcessor

PEER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "blocks": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        "online": {"type": "boolean"},
        "role": {"enum": ["server", "client", "relay"]},
    },
    "required": ["name", "blocks", "online", "role"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a peer as JSON"}]
PROMPT_AS_TEXT = "User: Describe a peer as JSON\nAssistant:"  # the plain chat template (prompts.py)


def _json_schema(schema: dict, strict: bool | None = True, name: str = "peer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


class _LlguidanceMask(LogitsProcessor):
    """llguidance's mask as its documentation applies it, written here apart from bloompeer's processor:
    the matcher takes each new token, and the tokens its logit bias gives 0 are set to -inf."""

    def __init__(self, tokenizer, schema: dict, prompt_length: int):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        self.matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar)
        self.prompt_length = prompt_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_length:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        return scores.masked_fill(allowed[:scores.shape[-1]] == 0, float("-inf"))


def _content(response, stream: bool, n: int = 1) -> list[str]:
    if not stream:
        assert all(choice.finish_reason == "stop" for choice in response.choices)
        return [choice.message.content for choice in response.choices]
    texts, finished = [""] * n, [None] * n
    for chunk in response:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert finished == ["stop"] * n
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_json_schema_equals_transformers_under_llguidance(client, model_id, reference_model, tokenizer,
                                                                 stream):
    prompt = tokenizer(PROMPT_AS_TEXT).input_ids
    with torch.inference_mode():
        output = reference_model.generate(torch.tensor([prompt]), max_new_tokens=80, do_sample=False,
                                          logits_processor=[_LlguidanceMask(tokenizer, PEER, len(prompt))],
                                          pad_token_id=tokenizer.pad_token_id)
    expected = tokenizer.decode(output[0, len(prompt):], skip_special_tokens=True)
    jsonschema.validate(json.loads(expected), PEER)
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=80, temperature=0,
                                              response_format=_json_schema(PEER), stream=stream)
    assert _content(response, stream) == [expected]


@pytest.mark.parametrize("stream", [False, True])
def test_sampled_replies_parse_and_validate_with_n_choices(client, model_id, stream):
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=120, temperature=1.0,
                                              seed=7, n=4, response_format=_json_schema(PEER), stream=stream)
    replies = [json.loads(text) for text in _content(response, stream, n=4)]
    for reply in replies:
        jsonschema.validate(reply, PEER)
    assert len({json.dumps(reply) for reply in replies}) > 1  # each choice drew its own reply


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_replies_are_objects(client, model_id, stream):
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"}, stream=stream)
    assert isinstance(json.loads(_content(response, stream)[0]), dict)


def test_a_single_token_reply_is_constrained_too(client, model_id):
    """max_tokens 1 picks its token from the scoring pass (choices.py), under the same mask."""
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=1, temperature=0,
                                              response_format=_json_schema(PEER))
    assert response.choices[0].message.content == "{" and response.choices[0].finish_reason == "length"


class Peer(BaseModel):
    name: str = Field(max_length=6)
    port: int = Field(ge=1, le=99)
    role: Literal["server", "client"]
    online: bool


def test_parse_gives_the_pydantic_object(client, model_id):
    for parse in (client.chat.completions.parse, client.beta.chat.completions.parse):
        completion = parse(model=model_id, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=3,
                           response_format=Peer)
        peer = completion.choices[0].message.parsed
        assert isinstance(peer, Peer) and peer == Peer.model_validate_json(completion.choices[0].message.content)


def _error(raised) -> dict:
    return raised.value.body if "message" in raised.value.body else raised.value.body["error"]


@pytest.mark.parametrize("schema, strict, refused", [
    ({"type": "object", "properties": {"a": {"type": "widget"}}}, True, "Invalid type: widget"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, False, "/$defs/missing"),
    ({"type": "string", "pattern": "[a-"}, True, "unclosed character class"),
    ({"type": "object", "if": {"type": "object"}, "then": {}}, True, "Unimplemented keys"),
])
def test_a_schema_the_library_refuses_is_400_naming_it(client, model_id, schema, strict, refused):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=8,
                                       response_format=_json_schema(schema, strict, name="odd"))
    error = _error(raised)
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format", error
    assert refused in error["message"] and "'odd'" in error["message"], error


def test_without_strict_an_unimplemented_keyword_is_ignored(client, model_id):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False, "if": {"type": "object"}, "then": {}}
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=20, temperature=0,
                                              response_format=_json_schema(schema, strict=False))
    assert isinstance(json.loads(response.choices[0].message.content)["ok"], bool)


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_a_malformed_response_format_is_400(client, model_id, response_format, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=8, response_format=response_format)
    assert _error(raised)["param"] == param, _error(raised)
