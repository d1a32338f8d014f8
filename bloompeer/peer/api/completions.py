"""POST /v1/completions and /v1/chat/completions: plain JSON, or server-sent events (stream=true).

The response's status is decided before its body starts: generation runs until its first token
(routing and the prompt's pass through the swarm) before the handler answers, so a swarm that
cannot serve gives a 503 with the missing blocks named, even for a stream. A stream then sends
one event per token as it arrives, and `data: [DONE]`. If the HTTP client goes away (its stream
is cancelled, or a plain request's connection closes), the generation is cancelled, which closes
its inference session and frees the servers' caches.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from sse_starlette import EventSourceResponse

from .errors import ApiError, api_error_from
from .generation import Generation, GenerationRequest, TextPiece
from .openai_schema import (
    ChatCompletionRequest, CompletionRequest, chat_chunk, chat_response, completion_chunk, completion_response,
    new_id, usage,
)
from .prompts import chat_prompt_ids, check_prompt, completion_prompt_ids

__all__ = ["add_completion_routes"]


def add_completion_routes(app, state) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_parameters(state, body)
        prompt_ids = completion_prompt_ids(state.tokenizer, body.prompt, state.model.config.vocab_size)
        return await _answer(state, request, body, prompt_ids, _CompletionFormat(new_id("cmpl"), state.model_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_parameters(state, body)
        prompt_ids = chat_prompt_ids(state.tokenizer, body.messages)
        return await _answer(state, request, body, prompt_ids, _ChatFormat(new_id("chatcmpl"), state.model_id))


def _check_parameters(state, body) -> None:
    state.check_model(body.model)
    unsupported = body.unsupported()
    if unsupported:
        raise ApiError.invalid(f"{unsupported} is not supported by bloompeer: leave it at its default", unsupported)


class _CompletionFormat:
    def __init__(self, response_id: str, model: str):
        self.response_id, self.model = response_id, model

    def chunks(self, piece: TextPiece, first: bool) -> list[dict]:
        return [completion_chunk(self.response_id, self.model, piece.text, piece.finish_reason)]

    def response(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        return completion_response(self.response_id, self.model, text, finish_reason, prompt_tokens,
                                   completion_tokens)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**completion_chunk(self.response_id, self.model, "", None), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}


class _ChatFormat(_CompletionFormat):
    def chunks(self, piece: TextPiece, first: bool) -> list[dict]:
        chunks = [chat_chunk(self.response_id, self.model, {"role": "assistant", "content": ""}, None)] if first \
            else []
        if piece.text:
            chunks.append(chat_chunk(self.response_id, self.model, {"content": piece.text}, None))
        if piece.finish_reason is not None:
            chunks.append(chat_chunk(self.response_id, self.model, {}, piece.finish_reason))
        return chunks

    def response(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        return chat_response(self.response_id, self.model, text, finish_reason, prompt_tokens, completion_tokens)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**chat_chunk(self.response_id, self.model, {}, None), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}


async def _answer(state, request: Request, body, prompt_ids: list[int], output: _CompletionFormat):
    check_prompt(prompt_ids)
    generation = Generation(state.model, state.tokenizer, GenerationRequest(
        tuple(prompt_ids), body.max_new_tokens, body.temperature, body.top_p, body.seed, body.stop_sequences),
        state.pool)
    metrics, model = state.metrics, state.model_id
    generation.on_token = metrics.timer(model, generation.started_at)
    metrics.prompt_tokens.labels(model).inc(len(prompt_ids))
    metrics.in_progress.labels(model).inc()
    ended = _Ending(metrics, model, generation)
    pieces = generation.__aiter__()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, generation))
    try:
        generation.start()
        first = await anext(pieces)  # the first token, or the reason there is none
        if body.stream:
            watcher.cancel()  # from here the stream's own disconnect detection takes over
            return EventSourceResponse(_events(first, pieces, output, body, len(prompt_ids), ended))
        text = [first.text]
        last = first
        async for last in pieces:
            text.append(last.text)
        ended(last.finish_reason)
        return output.response("".join(text), last.finish_reason, len(prompt_ids), last.completion_tokens)
    except BaseException as exc:
        ended("error")
        if isinstance(exc, Exception):
            raise api_error_from(exc) from exc
        raise
    finally:
        watcher.cancel()


class _Ending:
    """Counts a generation's end once, by reason, and cancels it (a no-op if it finished)."""

    def __init__(self, metrics, model: str, generation: Generation):
        self.metrics, self.model, self.generation, self.done = metrics, model, generation, False

    def __call__(self, reason: str) -> None:
        """reason: how it ended (finish_reason, or "error"); "disconnect" if the client left, whatever it was."""
        if self.done:
            return
        self.done = True
        if self.generation.cancelled.is_set():
            reason = "disconnect"
        self.generation.cancel()
        self.metrics.generations.labels(self.model, reason).inc()
        self.metrics.in_progress.labels(self.model).dec()


async def _events(first: TextPiece, pieces: AsyncIterator[TextPiece], output: _CompletionFormat, body,
                  prompt_tokens: int, ended: Callable[[str], None]) -> AsyncIterator[str]:
    """The SSE data of a stream: chunks as tokens arrive, an error event if the swarm fails midway."""
    piece, is_first = first, True
    try:
        while True:
            for chunk in output.chunks(piece, is_first):
                yield json.dumps(chunk)
            is_first = False
            if piece.finish_reason is not None:
                break
            piece = await anext(pieces)
        ended(piece.finish_reason)
        if body.include_usage_chunk:
            yield json.dumps(output.usage_chunk(prompt_tokens, piece.completion_tokens))
    except Exception as exc:
        ended("error")
        yield json.dumps(api_error_from(exc).body)
    finally:
        ended("disconnect")  # only counts if nothing above did: the client left (the task was cancelled)
    yield "[DONE]"


async def _cancel_on_disconnect(request: Request, generation: Generation) -> None:
    """Cancel the generation when the HTTP client goes away before its answer is sent."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    generation.cancel()

