"""One choice's generation: transformers' generate on a worker thread, its tokens as pieces on
the event loop.

generate() blocks for the whole generation (each step is a round trip through the swarm), so it
runs on a thread of the generation pool, never on the event loop; every choice is its own
generate() call, hence its own inference session on the servers, and the servers batch the
steps of concurrent choices (of one request, with `n` or several prompts, or of many). Tokens
come back through a streamer that makes them into text pieces, on the worker too (each decodes
the text so far: on the event loop, a long stream would cost every other request more with each
token), and hands those to an asyncio queue. When the HTTP client goes away, cancel() stops the
generation where it is: the step in flight is cancelled on the client's loop (even one waiting
minutes for servers of missing blocks), a stopping criterion catches it between steps, and
generate() closes its session on the way out, which frees the servers' caches at once.

How a token is picked is sampling.py's; with logprobs, the first logits processor keeps each
step's log-softmax of the model's own logits, before any other processor changes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..client.runtime import Cancellation
from .logprobs import top_alternatives
from .pieces import PieceMaker, TextPiece, TokenScore
from .sampling import Sampling

__all__ = ["GenerationRequest", "Generation", "TextPiece", "eos_ids", "retrieve_exception"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stops: tuple[str, ...] = ()
    num_logprobs: int | None = None  # None: no logprobs; k: each token's logprob and its k best alternatives
    special_tokens: bool = False  # the text keeps special tokens (harmony's channel markers, replies.py)


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


class _Cancelled(StoppingCriteria):
    def __init__(self, event: Cancellation):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class _StopSequences(StoppingCriteria):
    """True once the generated text contains a stop sequence (the text is cut there afterwards).

    Only the end of the text is decoded each step, the tokens that may hold a stop sequence ending in
    the new ones: every token is at least one byte of text, and a character at most four, so a stop
    of L characters spans at most 4 L tokens. (Decoding the whole text each step would cost more
    with every token: 0.4 ms a step at 2048 tokens of the demo model's tokenizer, 0.9 ms at 4096.)
    """

    def __init__(self, tokenizer, prompt_length: int, stops: tuple[str, ...]):
        self.tokenizer, self.prompt_length, self.stops = tokenizer, prompt_length, stops
        self.reach = 4 * max(len(stop) for stop in stops)
        self.checked = prompt_length  # the tokens before this one were checked (the prompt never counts)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        start = max(self.prompt_length, self.checked - self.reach)
        texts = self.tokenizer.batch_decode(input_ids[:, start:], skip_special_tokens=True)
        self.checked = input_ids.shape[1]
        return torch.tensor([any(stop in text for stop in self.stops) for text in texts], dtype=torch.bool)


class _RecordLogprobs(LogitsProcessor):
    """First of the processors: keeps this step's log-softmax of the model's own logits, for the
    streamer to look up the chosen token's logprob and the best alternatives."""

    def __init__(self, num_top: int):
        self.num_top, self.latest = num_top, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.latest = torch.log_softmax(scores[0].float(), dim=-1)  # [vocab]
        return scores

    def score(self, token_id: int) -> TokenScore:
        return (float(self.latest[token_id]), *top_alternatives(self.latest, self.num_top))


class _QueueStreamer(BaseStreamer):
    """generate() calls put() on its thread: once with the prompt, then with each new token."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, pieces: PieceMaker,
                 on_token: Callable[[float], None], logprobs: _RecordLogprobs | None):
        self.loop, self.queue, self.pieces, self.on_token, self.logprobs = loop, queue, pieces, on_token, logprobs
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.on_token(time.perf_counter())
        token_ids = value.reshape(-1).tolist()
        scores = [self.logprobs.score(token_id) for token_id in token_ids] if self.logprobs else None
        piece = self.pieces.add(token_ids, scores)
        if piece is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)

    def end(self) -> None:
        pass  # the worker puts the end marker itself, after generate() has returned (its session closed)


def retrieve_exception(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.debug("Generation failed: %r", future.exception())


class Generation:
    """One choice's generate() on the pool, read as TextPieces with `async for piece in generation`.

    Call cancel() when nobody reads any more (the client left); it is safe to call at any time, from
    any thread, and stops the work through the swarm too (see the module docstring).
    `on_token(seconds)` is called on the worker thread with each token's arrival time.
    """

    def __init__(self, model, tokenizer, request: GenerationRequest, pool: Executor,
                 on_token: Callable[[float], None] = lambda at: None):
        self.model, self.tokenizer, self.request, self.pool = model, tokenizer, request, pool
        self.on_token = on_token
        self.cancelled = Cancellation()
        self.started_at = time.perf_counter()
        self._queue: asyncio.Queue | None = None
        self._future: asyncio.Future | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._future = loop.run_in_executor(self.pool, self._run, loop)
        self._future.add_done_callback(retrieve_exception)  # a stream left early never awaits it

    def cancel(self) -> None:
        self.cancelled.cancel()

    async def __aiter__(self) -> AsyncIterator[TextPiece]:
        while (piece := await self._queue.get()) is not None:
            yield piece
        await self._future  # raises what generate() raised (its last piece then never came)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            if not self.cancelled.is_set():  # the client may have left while the request waited for a thread
                with self.model.client.runtime.cancellable(self.cancelled):
                    self._generate(loop)
        finally:
            with contextlib.suppress(RuntimeError):  # the HTTP loop is closed (the API stopped): nobody reads
                loop.call_soon_threadsafe(self._queue.put_nowait, None)

    def _generate(self, loop: asyncio.AbstractEventLoop) -> None:
        request = self.request
        input_ids = torch.tensor([request.prompt_ids], dtype=torch.long)
        criteria = StoppingCriteriaList([_Cancelled(self.cancelled)])
        if request.stops:
            criteria.append(_StopSequences(self.tokenizer, input_ids.shape[1], request.stops))
        recorder = None if request.num_logprobs is None else _RecordLogprobs(request.num_logprobs)
        processors = request.sampling.processors(input_ids.shape[1])
        if recorder is not None:
            processors.insert(0, recorder)
        pad_token_id = self.tokenizer.pad_token_id
        pieces = PieceMaker(self.tokenizer, request.stops, request.max_new_tokens, eos_ids(self.model),
                            recorder is not None, request.special_tokens)
        with torch.inference_mode():
            self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=request.max_new_tokens,
                min_new_tokens=0, do_sample=False, logits_processor=processors, stopping_criteria=criteria,
                streamer=_QueueStreamer(loop, self._queue, pieces, self.on_token, recorder),
                pad_token_id=pad_token_id if pad_token_id is not None else self.tokenizer.eos_token_id)
        loop.call_soon_threadsafe(self._queue.put_nowait, pieces.finish())
