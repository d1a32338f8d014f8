"""The OpenAI wire format: request bodies as validated pydantic models, responses as plain dicts.

Only what bloompeer can honour is accepted; a known OpenAI parameter it cannot honour (n > 1,
logprobs, penalties, ...) is refused with a 400 naming it, rather than silently ignored. Unknown
extra fields are ignored, as OpenAI-compatible servers commonly do (clients send `user`, ...).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions", "chat_chunk", "chat_response",
    "completion_chunk", "completion_response", "error_body", "model_list", "new_id", "usage",
]

MAX_STOP_SEQUENCES = 4  # as OpenAI
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
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(stop == "" for stop in stops):
            raise ValueError("a stop sequence cannot be empty")
        return stops

    def unsupported(self) -> str | None:
        """The first parameter set to something bloompeer does not do, or None."""
        if self.n != 1:
            return "n"
        if self.logprobs not in (None, False):
            return "logprobs"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty" if self.presence_penalty else "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        return None

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.best_of not in (None, 1):
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """The content as text; of the content parts only text parts are accepted."""
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    tools: list[Any] | None = None

    def unsupported(self) -> str | None:
        return "tools" if self.tools else super().unsupported()

    @property
    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}} (+ bloompeer's extras)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code, **extra}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_list(models: list[tuple[str, list[int]]], created: int) -> dict[str, Any]:
    """models: (id, missing block indices) pairs."""
    return {"object": "list", "data": [
        {"id": model_id, "object": "model", "created": created, "owned_by": "bloompeer",
         "all_blocks_covered": not missing, "missing_blocks": missing}
        for model_id, missing in models]}


def completion_response(response_id: str, model: str, text: str, finish_reason: str,
                        prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(response_id: str, model: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_response(response_id: str, model: str, text: str, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(response_id: str, model: str, delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
    return {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
