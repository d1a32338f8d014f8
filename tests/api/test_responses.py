"""/v1/responses through the official openai client (`client.responses.create`) against `bloompeer api`
over the shared swarm: a response is the chat reply to the same conversation (instructions as the
system message, function calls and their outputs as the assistant's calls and tool messages), plain
or streamed as OpenAI's typed events, which the client parses into its own types; tools and a JSON
schema hold the same guarantees as in chat; previous_response_id continues a stored conversation
exactly as sending it whole does; an unknown id is a 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
PEER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "port": {"type": "integer",
        "minimum": 1, "maximum": 99}}, "required": ["name", "port"], "additionalProperties": False}


def _chat_text(client, model_id, messages, **kwargs) -> str:
    return client.chat.completions.create(model=model_id, messages=messages, temperature=0, **kwargs) \
        .choices[0].message.content


def test_a_response_is_the_chat_reply_to_the_same_conversation(client, model_id):
    response = client.responses.create(model=model_id, input="Who is Mr. Darcy?", instructions="Be brief.",
                                       max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=model_id, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Mr. Darcy?"}])
    assert response.output_text == chat.choices[0].message.content != ""
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert response.usage.output_tokens_details.reasoning_tokens == 0  # a template without thinking
    assert [item.type for item in response.output] == ["message"] and response.id.startswith("resp_")


def test_a_streamed_response_sends_typed_events(client, model_id):
    plain = client.responses.create(model=model_id, input="Hello", max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model=model_id, input="Hello", max_output_tokens=10, temperature=0,
                                          stream=True))
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == plain.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].response.output_text == plain.output_text and events[-1].response.usage.output_tokens == 10


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_is_a_function_call_item(client, model_id, stream):
    response = client.responses.create(model=model_id, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice="required", max_output_tokens=120, temperature=1.0, stream=stream)
    if stream:
        events = list(response)
        added = [event for event in events if event.type == "response.output_item.added"]
        assert [event.item.type for event in added] == ["function_call"] and added[0].item.name == "get_weather"
        deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
        done, = [event for event in events if event.type == "response.function_call_arguments.done"]
        assert types_before(events, "response.function_call_arguments.delta", "response.output_item.added")
        assert "".join(deltas) == done.arguments
        response = events[-1].response
    call, = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.status == "completed"


def types_before(events, later: str, earlier: str) -> bool:
    types = [event.type for event in events]
    return types.index(earlier) < types.index(later)


def test_function_call_outputs_continue_the_conversation(client, model_id):
    """The second turn, with the call and its output as items, is chat's reply to the call and a tool message."""
    first = client.responses.create(model=model_id, input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=120, temperature=0)
    call = first.output[0]
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    second = client.responses.create(model=model_id, input=items, tools=[WEATHER], tool_choice="none",
                                      max_output_tokens=10, temperature=0)
    chat = _chat_text(client, model_id, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none", max_tokens=10)
    assert second.output_text == chat


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_text_format_always_parses(client, model_id, stream):
    text = {"format": {"type": "json_schema", "name": "peer", "schema": PEER, "strict": True}}
    response = client.responses.create(model=model_id, input="Describe a peer", text=text, max_output_tokens=60,
                                       temperature=1.0, stream=stream)
    if stream:
        response = list(response)[-1].response
    jsonschema.validate(json.loads(response.output_text), PEER)
    assert response.status == "completed" and response.text.format.type == "json_schema"


def test_previous_response_id_continues_the_stored_conversation(client, model_id):
    first = client.responses.create(model=model_id, input="Hello", max_output_tokens=6, temperature=0)
    follow = client.responses.create(model=model_id, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    whole = client.responses.create(model=model_id, max_output_tokens=8, temperature=0, store=False, input=[
        {"role": "user", "content": "Hello"}, *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And then?"}])
    assert follow.output_text == whole.output_text and follow.previous_response_id == first.id
    with pytest.raises(openai.BadRequestError) as raised:  # store false: not kept
        client.responses.create(model=model_id, input="x", previous_response_id=whole.id, max_output_tokens=2)
    assert raised.value.body["param"] == "previous_response_id"


def test_an_unknown_previous_response_id_is_400(client, model_id):
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=model_id, input="x", previous_response_id="resp_nothing", max_output_tokens=2)
    error = raised.value.body
    assert error["type"] == "invalid_request_error" and error["code"] == "previous_response_not_found"
    assert "resp_nothing" in error["message"]


@pytest.mark.parametrize("changes, param", [
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools.0.name"),
    ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "messages.0.tool_call_id"),
])
def test_bad_input_is_400(client, model_id, changes, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**{"model": model_id, "input": "x", "max_output_tokens": 2, **changes})
    assert raised.value.body["param"] == param, raised.value.body
