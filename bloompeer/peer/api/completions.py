"""POST /v1/completions and /v1/chat/completions: plain JSON, or server-sent events (stream=true).

The response's status is decided before its body starts: every choice runs until its first piece
(routing, and the prompt's pass through the swarm) before the handler answers, so a swarm that
cannot serve gives a 503 with the missing blocks named, even for a stream. A stream then sends
each choice's pieces as they arrive (choices interleaved, each chunk naming its index), and
`data: [DONE]`. If the HTTP client goes away (its stream is cancelled, or a plain request's
connection closes), the request's work is cancelled where it is (RequestChoices.cancel): each
generation's step in flight and the scoring pass's forward stop on the client's loop, and every
inference session is closed, which frees the servers' caches.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from sse_starlette import EventSourceResponse

from .choices import Choice, RequestChoices, interleave
from .constrained import Grammar
from .errors import ApiError, api_error_from
from .logprobs import chat_logprobs, completion_logprobs
from .openai_schema import ChatCompletionRequest, CompletionRequest, new_id, response_object, tool_call, tool_call_delta
from .pieces import TextPiece
from .prompts import MAX_PROMPTS, chat_prompt_ids, check_prompt, completion_prompts
from .response_format import response_grammar
from .replies import ReplyFormat, read_whole
from .tools import ChatTools

__all__ = ["PreparedChat", "add_completion_routes", "answer", "prepare_chat"]


def add_completion_routes(app, state) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_parameters(state, body)
        prompts = completion_prompts(state.tokenizer, body.prompt, state.model.config.vocab_size)
        return await answer(state, request, body, prompts, _CompletionFormat(new_id("cmpl"), state.model_id, body),
                             echo=body.echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        chat = await prepare_chat(state, body)
        return await answer(state, request, body, [chat.prompt], _ChatFormat(new_id("chatcmpl"), state.model_id, body,
                                                                             chat.reply), echo=False, chat=chat)


@dataclass(frozen=True)
class PreparedChat:
    """A chat request made ready to generate: its prompt, its grammar, how its replies are read."""

    prompt: list[int]
    grammar: Grammar | None
    reply: ReplyFormat


async def prepare_chat(state, body: ChatCompletionRequest) -> PreparedChat:
    """Chat and responses (responses.py) alike: parameters checked, the prompt through the template,
    the grammar compiled (off the event loop)."""
    _check_parameters(state, body)
    tools = ChatTools.of(body, state.tokenizer)
    prompt = chat_prompt_ids(state.tokenizer, body.messages, tools, body.chat_template_kwargs)
    check_prompt(prompt)
    grammar = await asyncio.to_thread(_chat_grammar, state, body, tools)
    return PreparedChat(prompt, grammar, ReplyFormat.of(state.tokenizer, prompt, tools, constrained=grammar is not None))


def _chat_grammar(state, body, tools: ChatTools | None) -> Grammar | None:
    """A required or named call's grammar, else response_format's (which, with tools on auto, the
    reply's content follows: the model can then call only where a call fits that grammar)."""
    tool_grammar = tools.grammar(state.grammars, state.tokenizer) if tools is not None else None
    return tool_grammar or response_grammar(state.grammars, body.response_format)


def _check_parameters(state, body) -> None:
    state.check_model(body.model)
    unsupported = body.unsupported()
    if unsupported:
        raise ApiError.invalid(f"{unsupported} is not supported by bloompeer: leave it at its default", unsupported)
    vocab_size = state.model.config.vocab_size
    for token in body.logit_bias or {}:
        if int(token) >= vocab_size:
            raise ApiError.invalid(f"logit_bias: token ids must be in 0..{vocab_size - 1}, not {token}", "logit_bias")


class _CompletionFormat:
    """A response's shape: plain (response, choice) and streamed (opening, chunks, closing events)."""

    object_name, chunk_object_name = "text_completion", "text_completion"
    done_marker = "[DONE]"  # the stream's last data

    def __init__(self, response_id: str, model: str, body):
        self.response_id, self.model, self.with_logprobs = response_id, model, body.num_logprobs is not None

    def _logprobs(self, entries) -> dict | None:
        return completion_logprobs(entries) if self.with_logprobs else None

    def chunks(self, index: int, piece: TextPiece, first: bool) -> list[dict]:
        return [self._chunk([{"index": index, "text": piece.text, "logprobs": self._logprobs(piece.logprobs),
                              "finish_reason": piece.finish_reason}])]

    def choice(self, index: int, pieces: list[TextPiece]) -> dict:
        return {"index": index, "text": "".join(piece.text for piece in pieces),
                "logprobs": self._logprobs([entry for piece in pieces for entry in piece.logprobs]),
                "finish_reason": pieces[-1].finish_reason}

    def response(self, choices: list[dict], usage_counts: tuple[int, int]) -> dict:
        return response_object(self.response_id, self.object_name, self.model, choices, usage_counts)

    def opening(self) -> list[dict]:
        return []

    def closing(self, usage_counts: tuple[int, int], body) -> list[dict]:
        return [self._chunk([], usage_counts)] if body.include_usage_chunk else []

    def error_event(self, error: ApiError) -> dict:
        return error.body

    def sse(self, event: dict):
        """An event as EventSourceResponse sends it."""
        return json.dumps(event)

    def _chunk(self, choices: list[dict], usage_counts: tuple[int, int] | None = None) -> dict:
        return response_object(self.response_id, self.chunk_object_name, self.model, choices, usage_counts)


class _ChatFormat(_CompletionFormat):
    """Chat's shape; each choice's text read as reasoning, content and tool calls (replies.py)."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, body, reply: ReplyFormat):
        super().__init__(response_id, model, body)
        self.reply, self.readers = reply, {}

    def _logprobs(self, entries) -> dict | None:
        return chat_logprobs(entries) if self.with_logprobs else None

    def chunks(self, index: int, piece: TextPiece, first: bool) -> list[dict]:
        def chunk(delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
            return self._chunk([{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason}])

        chunks = [chunk({"role": "assistant", "content": ""})] if first else []
        if self.reply.plain:
            if piece.text or piece.logprobs:
                chunks.append(chunk({"content": piece.text}, logprobs=self._logprobs(piece.logprobs)))
        else:
            reader = self.readers.setdefault(index, self.reply.reader())
            deltas = reader.add(piece.text) + (reader.finish() if piece.finish_reason is not None else [])
            for delta in deltas:  # a piece's logprobs go with its content; reasoning's and a call's have none
                if delta[0] == "content":
                    chunks.append(chunk({"content": delta[1]}, logprobs=self._logprobs(piece.logprobs)))
                elif delta[0] == "reasoning":
                    chunks.append(chunk({"reasoning_content": delta[1]}))
                else:
                    chunks.append(chunk({"tool_calls": [_tool_call_delta(delta)]}))
        if piece.finish_reason is not None:
            chunks.append(chunk({}, self._finish_reason(index, piece.finish_reason)))
        return chunks

    def _finish_reason(self, index: int, reason: str) -> str:
        reader = self.readers.get(index)
        return "tool_calls" if reason == "stop" and reader is not None and reader.calls else reason

    def choice(self, index: int, pieces: list[TextPiece]) -> dict:
        choice = super().choice(index, pieces)
        message = {"role": "assistant", "content": choice["text"]}
        if not self.reply.plain:
            reader = self.readers[index] = self.reply.reader()
            reply = read_whole(reader, choice["text"])
            message["content"] = reply.content or (None if reply.calls else "")
            if reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            if reply.calls:
                message["tool_calls"] = [tool_call(*call) for call in reply.calls]
        return {"index": index, "message": message, "logprobs": choice["logprobs"],
                "finish_reason": self._finish_reason(index, choice["finish_reason"])}


def _tool_call_delta(delta: tuple) -> dict:
    if delta[0] == "call":
        _, index, call_id, name = delta
        return tool_call_delta(index, "", call_id, name)
    return tool_call_delta(delta[1], delta[2])


async def answer(state, request: Request, body, prompts: list[list[int]], output: _CompletionFormat, echo: bool,
                 chat: PreparedChat | None = None):
    """The response to a request of `prompts`, plain or streamed, shaped by `output`."""
    if len(prompts) * body.n > MAX_PROMPTS:
        raise ApiError.invalid(f"n: at most {MAX_PROMPTS} choices per request (prompts x n), got "
                               f"{len(prompts)} x {body.n}", "n")
    choices = RequestChoices(state, prompts, body, echo, chat and chat.grammar, chat is not None and
                             chat.reply.special_tokens)
    metrics, model = state.metrics, state.model_id
    metrics.prompt_tokens.labels(model).inc(choices.prompt_tokens)
    endings = [_Ending(metrics, model, choice) for choice in choices.choices]
    watcher = asyncio.create_task(_cancel_on_disconnect(request, choices))
    iterators = [choice.pieces() for choice in choices.choices]
    try:
        choices.start()
        firsts = await _first_pieces(iterators)  # each choice's first piece, or the reason there is none
        if body.stream:
            watcher.cancel()  # from here the stream's own disconnect detection takes over
            return EventSourceResponse(_events(firsts, iterators, output, body, choices, endings))
        pieces = await asyncio.gather(*(_rest(first, iterator) for first, iterator in zip(firsts, iterators)))
        for ending, choice_pieces in zip(endings, pieces):
            ending(choice_pieces[-1].finish_reason)
        completion_tokens = sum(choice_pieces[-1].completion_tokens for choice_pieces in pieces)
        return output.response([output.choice(index, choice_pieces) for index, choice_pieces in enumerate(pieces)],
                               (choices.prompt_tokens, completion_tokens))
    except BaseException as exc:
        for ending in endings:
            ending("error")
        choices.cancel()  # the work of every choice, and the scoring pass: nobody will read them
        if isinstance(exc, Exception):
            raise api_error_from(exc) from exc
        raise
    finally:
        watcher.cancel()


async def _first_pieces(iterators: list[AsyncIterator[TextPiece]]) -> list[TextPiece]:
    tasks = [asyncio.ensure_future(anext(iterator)) for iterator in iterators]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def _rest(first: TextPiece, iterator: AsyncIterator[TextPiece]) -> list[TextPiece]:
    pieces = [first]
    async for piece in iterator:
        pieces.append(piece)
    return pieces


class _Ending:
    """Counts a choice's end once, by reason, and cancels it (a no-op if it finished)."""

    def __init__(self, metrics, model: str, choice: Choice):
        self.metrics, self.model, self.source, self.done = metrics, model, choice.source, False
        self.source.on_token = metrics.timer(model, self.source.started_at)
        metrics.in_progress.labels(model).inc()

    def __call__(self, reason: str) -> None:
        """reason: how it ended (finish_reason, or "error"); "disconnect" if the client left, whatever it was."""
        if self.done:
            return
        self.done = True
        if self.source.cancelled.is_set():
            reason = "disconnect"
        self.source.cancel()
        self.metrics.generations.labels(self.model, reason).inc()
        self.metrics.in_progress.labels(self.model).dec()


async def _events(firsts: list[TextPiece], iterators: list[AsyncIterator[TextPiece]], output: _CompletionFormat,
                  body, choices: RequestChoices, endings: list[_Ending]) -> AsyncIterator[str]:
    """The SSE data of a stream: chunks as pieces arrive, an error event if the swarm fails midway."""
    completion_tokens, started, prompt_tokens = 0, set(), choices.prompt_tokens
    try:
        for event in output.opening():
            yield output.sse(event)
        async for index, piece in interleave([_prepend(first, rest) for first, rest in zip(firsts, iterators)]):
            for chunk in output.chunks(index, piece, index not in started):
                yield output.sse(chunk)
            started.add(index)
            if piece.finish_reason is not None:
                endings[index](piece.finish_reason)
                completion_tokens += piece.completion_tokens
        for event in output.closing((prompt_tokens, completion_tokens), body):
            yield output.sse(event)
    except Exception as exc:
        for ending in endings:
            ending("error")
        yield output.sse(output.error_event(api_error_from(exc)))
    finally:
        for ending in endings:  # only counts those nothing above did: the client left (the task was cancelled)
            ending("disconnect")
        choices.cancel()  # what still runs (a scoring pass a choice did not wait for) stops too
    if output.done_marker:
        yield output.done_marker


async def _prepend(first: TextPiece, iterator: AsyncIterator[TextPiece]) -> AsyncIterator[TextPiece]:
    yield first
    async for piece in iterator:
        yield piece


async def _cancel_on_disconnect(request: Request, choices: RequestChoices) -> None:
    """Cancel the choices when the HTTP client goes away before its answer is sent."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    choices.cancel()
