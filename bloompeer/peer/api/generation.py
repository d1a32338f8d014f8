"""One API request's generation: transformers' generate on a worker thread, its tokens as events
on the event loop.

generate() blocks for the whole generation (each step is a round trip through the swarm), so it
runs on a thread of the generation pool, never on the event loop; every request is its own
generate() call, hence its own inference session on the servers, and the servers batch the
steps of concurrent requests. Tokens come back through a streamer that hands them to an
asyncio queue. A cancel event, set when the HTTP client goes away, is a stopping criterion:
generate() returns after the step in flight and closes its session, which frees the servers'
caches at once.

Sampling draws from a torch.Generator of the request's own (seeded by `seed`), so a seeded
request gives the same text however many others run at the same time: transformers' own
warpers shape the distribution, and the last logits processor draws the token and leaves only
it possible, so generate's greedy pick takes it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, TemperatureLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer

from .decoding import IncrementalText

__all__ = ["GenerationRequest", "Generation", "TextPiece"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stops: tuple[str, ...] = ()


@dataclass(frozen=True)
class TextPiece:
    """What a stream sends next: new text, and on the last piece why generation ended."""

    text: str
    finish_reason: str | None = None  # "stop" (end of text or a stop sequence) | "length" | None: not the last
    completion_tokens: int = 0  # tokens generated so far


class _Cancelled(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class _StopSequences(StoppingCriteria):
    """True once the generated text contains a stop sequence (the text is cut there afterwards)."""

    def __init__(self, tokenizer, prompt_length: int, stops: tuple[str, ...]):
        self.tokenizer, self.prompt_length, self.stops = tokenizer, prompt_length, stops

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_length:], skip_special_tokens=True)
        return torch.tensor([any(stop in text for stop in self.stops) for text in texts], dtype=torch.bool)


class _SampleWithGenerator(LogitsProcessor):
    """Draws the next token from softmax(scores) with the request's generator; only it stays possible."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator)  # [batch, 1]
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


class _QueueStreamer(BaseStreamer):
    """generate() calls put() on its thread: once with the prompt, then with each new token."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue,
                 on_token: Callable[[float], None]):
        self.loop, self.queue, self.on_token = loop, queue, on_token
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.on_token(time.perf_counter())
        self.loop.call_soon_threadsafe(self.queue.put_nowait, value.reshape(-1).tolist())

    def end(self) -> None:
        pass  # the worker puts the end marker itself, after generate() has returned (its session closed)


def _retrieve_exception(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.debug("Generation failed: %r", future.exception())


class Generation:
    """One request's generate() on the pool, read as TextPieces with `async for piece in generation`.

    Call cancel() when nobody reads any more (the client left); it is safe to call at any time.
    `on_token(seconds)` is called on the worker thread with each token's arrival time.
    """

    def __init__(self, model, tokenizer, request: GenerationRequest, pool: Executor,
                 on_token: Callable[[float], None] = lambda at: None):
        self.model, self.tokenizer, self.request, self.pool = model, tokenizer, request, pool
        self.on_token = on_token
        self.cancelled = threading.Event()
        self.started_at = time.perf_counter()
        self._queue: asyncio.Queue | None = None
        self._future: asyncio.Future | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._future = loop.run_in_executor(self.pool, self._run, loop)
        self._future.add_done_callback(_retrieve_exception)  # a stream left early never awaits it

    def cancel(self) -> None:
        self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[TextPiece]:
        text = IncrementalText(self.tokenizer, self.request.stops)
        num_tokens, eos_ids = 0, self._eos_ids()
        last_token = None
        while (item := await self._queue.get()) is not None:
            num_tokens += len(item)
            last_token = item[-1]
            piece = text.add(item)
            if piece:
                yield TextPiece(piece, None, num_tokens)
        await self._future  # raises what generate() raised
        stopped = text.stopped or last_token in eos_ids or num_tokens < self.request.max_new_tokens
        yield TextPiece(text.finish(), "stop" if stopped else "length", num_tokens)

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            if not self.cancelled.is_set():  # the client may have left while the request waited for a thread
                self._generate(loop)
        finally:
            loop.call_soon_threadsafe(self._queue.put_nowait, None)

    def _generate(self, loop: asyncio.AbstractEventLoop) -> None:
        request = self.request
        input_ids = torch.tensor([request.prompt_ids], dtype=torch.long)
        criteria = StoppingCriteriaList([_Cancelled(self.cancelled)])
        if request.stops:
            criteria.append(_StopSequences(self.tokenizer, input_ids.shape[1], request.stops))
        pad_token_id = self.tokenizer.pad_token_id
        with torch.inference_mode():
            self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=request.max_new_tokens,
                min_new_tokens=0, do_sample=False, logits_processor=self._sampling(), stopping_criteria=criteria,
                streamer=_QueueStreamer(loop, self._queue, self.on_token),
                pad_token_id=pad_token_id if pad_token_id is not None else self.tokenizer.eos_token_id)

    def _sampling(self) -> LogitsProcessorList:
        request = self.request
        if request.temperature == 0:
            return LogitsProcessorList()  # greedy
        generator = torch.Generator()
        if request.seed is None:
            generator.seed()
        else:
            generator.manual_seed(request.seed)
        processors = LogitsProcessorList()
        if request.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(request.temperature))
        if request.top_p < 1.0:
            processors.append(TopPLogitsWarper(request.top_p))
        processors.append(_SampleWithGenerator(generator))
        return processors
