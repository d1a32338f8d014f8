"""Chat tools through the official openai client against `bloompeer api` over the shared swarm (a BLOOM
checkpoint: no chat template, so calls are the plain JSON the prompt asks for): a required or named
call is always a valid call of the tool's schema, streamed name first and then its arguments, for
every one of n choices; `auto` keeps a reply that is not a call as the text the model wrote; tool
results are fed back through the prompt; bad tools and messages are 400s in OpenAI's shape."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _calls(response, stream: bool, n: int = 1) -> list[list[tuple[str, dict]]]:
    """Each choice's calls as (name, arguments); streamed, also checks OpenAI's order of deltas."""
    if not stream:
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        return [[(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls]
                for choice in response.choices]
    calls = [{} for _ in range(n)]
    finished = [None] * n
    for chunk in response:
        for choice in chunk.choices:
            assert not choice.delta.content
            finished[choice.index] = choice.finish_reason or finished[choice.index]
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls[choice.index]:  # a call's first delta: its id and name
                    assert delta.id.startswith("call_") and delta.function.name and delta.type == "function"
                    calls[choice.index][delta.index] = [delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function.name is None
                calls[choice.index][delta.index][1] += delta.function.arguments or ""
    assert finished == ["tool_calls"] * n
    return [[(name, json.loads(arguments)) for name, arguments in choice.values()] for choice in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_always_a_valid_call(client, model_id, stream):
    response = client.chat.completions.create(
        model=model_id, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=120, temperature=1.0, seed=11, n=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=stream)
    for calls in _calls(response, stream, n=3):
        assert [name for name, _ in calls] == ["get_weather"]
        jsonschema.validate(calls[0][1], PARAMETERS["get_weather"])


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_one_of_the_tools(client, model_id, stream):
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=120, temperature=1.0, seed=5, n=4,
                                              stream=stream)
    for calls in _calls(response, stream, n=4):
        (name, arguments), = calls
        jsonschema.validate(arguments, PARAMETERS[name])


def _text(response, stream: bool) -> str:
    if stream:
        chunks = list(response)
        assert not any(choice.delta.tool_calls for chunk in chunks for choice in chunk.choices)
        return "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
    assert response.choices[0].message.tool_calls is None
    return response.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_auto_keeps_a_reply_that_is_not_a_call_as_its_text(client, model_id, stream):
    """The same prompt with tool_choice none (the tools rendered, the reply never read as calls)."""
    def reply(tool_choice: str, stream: bool) -> str:
        return _text(client.chat.completions.create(model=model_id, messages=MESSAGES, tools=[WEATHER],
                                                    tool_choice=tool_choice, max_tokens=24, temperature=0,
                                                    stream=stream), stream)

    assert reply("auto", stream) == reply("none", False) != ""


def test_tool_results_are_fed_back_through_the_prompt(client, model_id, reference_model, tokenizer):
    """The plain template (docs/api.md): the functions in a system line, the call as its JSON, the
    result as a Tool line; the reply is what transformers continues that text with."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"utc"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    response = client.chat.completions.create(model=model_id, messages=messages, tools=[TIME], tool_choice="none",
                                              max_tokens=10, temperature=0)
    functions = json.dumps(TIME["function"])
    text = (f"System: You can call these functions:\n{functions}\nTo call one, reply with only a JSON object: "
            '{"name": <the function\'s name>, "arguments": <its arguments, a JSON object>}.\n'
            "User: What is the weather in Paris?\n"
            'Assistant: {"name": "get_time", "arguments": {"zone": "utc"}}\n'
            "Tool: 12:00\nAssistant:")
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        output = reference_model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert response.choices[0].message.content == tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)


def _error(raised) -> dict:
    return raised.value.body if "message" in raised.value.body else raised.value.body["error"]


@pytest.mark.parametrize("changes, param, said", [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name", "required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "vector"}}}]},
     "tools.0.function.parameters", "Invalid type: vector"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "get_time"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [TIME], "messages": [*MESSAGES, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "messages.1.tool_call_id", "call_9"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "x"}]}, "messages.1", "tool_call_id"),
])
def test_bad_tools_and_messages_are_400(client, model_id, changes, param, said):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**{"model": model_id, "messages": MESSAGES, "max_tokens": 4, **changes})
    error = _error(raised)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert said in error["message"], error


PEER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "port": {"type": "integer",
        "minimum": 1, "maximum": 99}}, "required": ["name", "port"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_a_response_format_answers_in_the_schema(client, model_id, stream):
    """The reply follows response_format's grammar (a call fits it nowhere here), so it is content that
    validates, never a call, with n sampled choices."""
    response = client.chat.completions.create(
        model=model_id, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=80, n=3, seed=2,
        temperature=1.0, stream=stream,
        response_format={"type": "json_schema", "json_schema": {"name": "peer", "schema": PEER, "strict": True}})
    if stream:
        texts = [""] * 3
        for chunk in response:
            for choice in chunk.choices:
                assert not choice.delta.tool_calls
                texts[choice.index] += choice.delta.content or ""
    else:
        assert all(choice.message.tool_calls is None and choice.finish_reason == "stop" for choice in response.choices)
        texts = [choice.message.content for choice in response.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), PEER)
