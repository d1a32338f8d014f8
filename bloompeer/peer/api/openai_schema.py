"""The OpenAI wire format: request bodies as validated pydantic models, responses as plain dicts.

Only what bloompeer can honour is accepted; a known OpenAI parameter it cannot honour (suffix,
best_of) is refused with a 400 naming it, rather than silently ignored. Unknown
extra fields are ignored, as OpenAI-compatible servers commonly do (clients send `user`, ...).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .constrained import Grammar
from .sampling import Sampling

__all__ = [
    "CalledFunction", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "FunctionDefinition",
    "JsonSchemaFormat", "MessageToolCall", "NamedToolChoice", "ResponseFormat", "StreamOptions", "Tool", "error_body",
    "model_list", "new_id", "response_object", "tool_call", "tool_call_delta", "usage",
]

MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_CHOICES = 128  # n, as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # as OpenAI's completions
MAX_CHAT_TOP_LOGPROBS = 20  # as OpenAI's chat
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256  # OpenAI's chat default is "up to the context"; a bounded one suits a swarm


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False  # one last chunk with usage and no choices, before [DONE]


class _SamplingRequest(BaseModel):
    """The parameters both endpoints share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # 0: greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices per prompt, each its own session
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as text) -> -100..100, added to its logit

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(stop == "" for stop in stops):
            raise ValueError("a stop sequence cannot be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        for token, bias in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys are token ids, as text: {token!r} is not one")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"a bias is between -100 and 100, not {bias} (token {token})")
        return value

    def unsupported(self) -> str | None:
        """The first parameter set to something bloompeer does not do, or None."""
        return None

    def sampling(self, choice: int, grammar: Grammar | None = None) -> Sampling:
        """How choice number `choice` of a prompt picks tokens: with a seed, each choice of a
        prompt draws its own numbers (seed + choice), the first exactly as a request with n=1;
        within `grammar` if given (response_format, tools)."""
        return Sampling(self.temperature, self.top_p, None if self.seed is None else self.seed + choice,
                        self.presence_penalty, self.frequency_penalty,
                        {int(token): bias for token, bias in (self.logit_bias or {}).items()}, grammar)

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]  # one text or token-id list, or several (a choice each)
    max_tokens: int | None = Field(default=None, ge=0)  # 0: nothing generated (with echo: the prompt scored)
    echo: bool = False  # the prompt's text (and with logprobs, its tokens' logprobs) before the completion
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # alternatives per token
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        def token_ids(item) -> bool:
            return isinstance(item, list) and all(isinstance(token, int) and not isinstance(token, bool)
                                                  for token in item)

        if isinstance(value, str) or (isinstance(value, list) and (
                all(isinstance(item, str) for item in value) or token_ids(value)
                or all(token_ids(item) for item in value))):
            return value
        raise ValueError("a prompt is a string, a list of strings, a list of token ids or a list of such lists")

    def unsupported(self) -> str | None:
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()

    @property
    def max_new_tokens(self) -> int:
        return DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # as OpenAI requires of function and schema names


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(BaseModel):
    """A call an assistant message made (fed back with the conversation)."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None  # None only for an assistant message that made tool calls
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its reasoning, as this API returned it (replies.py)

    @model_validator(mode="after")
    def _shape_of_role(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message of role tool needs the tool_call_id of the call it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: only an assistant message with tool_calls may have no content")
        return self

    def text(self) -> str:
        """The content as text; of the content parts only text parts are accepted (an image's is refused: the
        API serves text models, of a multimodal checkpoint such as Kimi K2.5 or Qwen3.5 its text model only)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for index, part in enumerate(self.content):
            if part.get("type") != "text":
                raise ValueError(f"content part {index} is of type {part.get('type')!r}: only text parts are taken "
                                 "(this API serves text models; of a multimodal checkpoint such as Kimi K2.5 or "
                                 "Qwen3.5, its text model only): send the message as text")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {index}: a text part needs its text as a string")
        return "".join(part["text"] for part in self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})  # JSON schema
    strict: bool | None = None  # as response_format's: true refuses schema keywords the grammar library lacks


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: _FunctionName


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the reply is JSON valid against `schema` (constrained.py)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")  # ("schema" is a BaseModel method)
    strict: bool | None = None  # true: a keyword the grammar library does not implement is a 400, not ignored


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: a response_format of type json_schema needs its json_schema")
        return self


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False  # each generated token's logprob
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)  # and its best alternatives
    response_format: ResponseFormat | None = None  # text (the default), json_object or json_schema
    tools: list[Tool] | None = None  # functions the model may call (tools.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True  # several calls in one reply, where the family's format has them
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template (Qwen3's enable_thinking)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: set logprobs to true to get top_logprobs")
        return self

    @property
    def tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the name of the function a named choice calls)."""
        if self.tool_choice == "none":
            return "none", None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named", self.tool_choice.function.name
        return self.tool_choice or "auto", None

    @property
    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}} (+ bloompeer's extras)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code, **extra}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_list(models: list[tuple[str, list[int], list[str]]], created: int) -> dict[str, Any]:
    """models: (id, missing block indices, how online servers store the weights: WeightFormat.label)."""
    return {"object": "list", "data": [
        {"id": model_id, "object": "model", "created": created, "owned_by": "bloompeer",
         "all_blocks_covered": not missing, "missing_blocks": missing, "weights": weights}
        for model_id, missing, weights in models]}


def response_object(response_id: str, object_name: str, model: str, choices: list[dict[str, Any]],
                    usage_counts: tuple[int, int] | None = None) -> dict[str, Any]:
    """A response or stream chunk: object_name is "text_completion", "chat.completion" or
    "chat.completion.chunk"; usage_counts: (prompt tokens, completion tokens) to include."""
    body = {"id": response_id, "object": object_name, "created": int(time.time()), "model": model,
            "choices": choices}
    if usage_counts is not None:
        body["usage"] = usage(*usage_counts)
    return body


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A call in a chat message's tool_calls; arguments: JSON text."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_call_delta(index: int, arguments: str, call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    """A stream chunk's part of a call: its id and name first (with no arguments yet), then arguments text."""
    if call_id is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, **tool_call(call_id, name, arguments)}
