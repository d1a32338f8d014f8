"""Agent frameworks against `bloompeer api` over the shared swarm (the session's one API process): the
OpenAI Agents SDK (through the Responses API and through chat completions), LangChain's ChatOpenAI
and pydantic-ai, each as a user sets it up, pointed at the API's URL.

The tiny model writes random text, so a run succeeds only by the API's guarantees: the first step is
forced to call the tool (tool_choice required or named), whose arguments are decoded under its
schema; the tool runs here and its output goes back through the framework's own messages; the last
step is constrained to the output type's JSON schema (or its output tool's). A test asserts the
whole round trip: the tool was called with valid arguments, its result was sent back, and the run
ended with an instance of the output type. No network is used (tracing off)."""

from __future__ import annotations

import asyncio
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

CITIES = Literal["Paris", "Rome", "Oslo"]


class Forecast(BaseModel):
    city: CITIES
    celsius: int = Field(ge=-30, le=50)
    sunny: bool


def _weather(calls: list[str], city: str) -> str:
    calls.append(city)
    return f"{city}: 18 C, sunny"


@pytest.mark.parametrize("api_kind", ["responses", "chat_completions"])
def test_openai_agents_sdk_runs_a_tool_then_gives_its_output_type(api, model_id, api_kind):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from agents.items import ToolCallOutputItem

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: CITIES) -> str:
        """The weather of a city."""
        return _weather(calls, city)

    client = openai.AsyncOpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120.0)
    model_class = OpenAIResponsesModel if api_kind == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="forecaster", instructions="Use the tool, then answer.", tools=[get_weather],
                  output_type=Forecast, model=model_class(model=model_id, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=120, temperature=1.0))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(calls) == 1 and len(result.raw_responses) == 2  # step 1: the call; step 2: the typed output
    outputs = [item.output for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert outputs == [f"{calls[0]}: 18 C, sunny"]
    assert isinstance(result.final_output, Forecast)


def test_langchain_bind_tools_and_with_structured_output(api, model_id):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calls: list[str] = []

    @tool
    def get_weather(city: CITIES) -> str:
        """The weather of a city."""
        return _weather(calls, city)

    llm = ChatOpenAI(model=model_id, base_url=api.url, api_key="unused", temperature=1.0, max_tokens=120,
                     max_retries=0, timeout=120)
    question = HumanMessage("What is the weather in Paris?")
    # strict: the schemas forbid other properties (else the random model adds some, unbounded, to max_tokens)
    reply = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke([question])
    call, = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome", "Oslo")
    result = get_weather.invoke(call)  # a ToolMessage answering the call's id
    assert isinstance(result, ToolMessage) and calls == [call["args"]["city"]]
    forecast = llm.with_structured_output(Forecast, strict=True).invoke([question, reply, result])
    assert isinstance(forecast, Forecast)


def test_pydantic_ai_agent_gives_a_typed_output(api, model_id):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls: list[str] = []
    model = OpenAIChatModel(model_id, provider=OpenAIProvider(base_url=api.url, api_key="unused"))

    def settings(ctx):
        """The tool at the first step, the output tool after it (a callable: per step, as pydantic-ai asks)."""
        return {"tool_choice": ["get_weather"] if ctx.run_step <= 1 else ["final_result"], "max_tokens": 120,
                "temperature": 1.0}

    agent = Agent(model, output_type=Forecast, model_settings=settings, instructions="Use the tool, then answer.")

    @agent.tool_plain
    def get_weather(city: CITIES) -> str:
        """The weather of a city."""
        return _weather(calls, city)

    result = asyncio.run(agent.run("What is the weather in Paris?"))
    assert len(calls) == 1 and isinstance(result.output, Forecast)
    returns = [part for message in result.all_messages() for part in message.parts
               if part.part_kind == "tool-return" and part.tool_name == "get_weather"]
    assert [part.content for part in returns] == [f"{calls[0]}: 18 C, sunny"]
