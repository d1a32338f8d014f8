"""The choices of one request: n per prompt, each read as TextPieces, all running at once.

Which way a choice gets its tokens:
- max_tokens >= 2: generate() on a session of its own (generation.py); the choices of a request
  run concurrently, so the servers batch their steps.
- max_tokens 0 or 1: no session. The request's prompts go through one scoring pass
  (scoring.py), and a choice's one token is picked from that pass's last logits by the same
  processors generate() would use (sampling.py).
All of it computes off the HTTP event loop: the scoring pass and generate() on the generation
threads, a choice's pick, its logprobs and the decoding of its text and echo on worker threads
(each runs processors, a softmax or a top-k over the whole vocabulary, or decodes a long prompt),
so that the loop keeps answering other requests (/health among them) meanwhile.
With `echo`, a choice starts with its prompt's text; with `echo` and `logprobs`, the scoring pass
(one per request, whatever n is) also gives the prompt tokens' logprobs.
cancel() (the HTTP client left) stops all of it, the scoring pass's forward through the swarm too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from ..client.errors import CallCancelledError
from ..client.runtime import Cancellation
from .constrained import Grammar
from .generation import Generation, GenerationRequest, retrieve_exception, eos_ids
from .logprobs import top_alternatives
from .pieces import PieceMaker, TextPiece, echo_piece
from .sampling import pick_token
from .scoring import PromptScores, score_prompts

__all__ = ["Choice", "RequestChoices", "interleave"]


class _ScoredChoice:
    """A choice of at most one token, picked from the scoring pass (same interface as Generation)."""

    def __init__(self, model, tokenizer, request: GenerationRequest,
                 scores: Callable[[], Awaitable[list[PromptScores]]], prompt_index: int):
        self.model, self.tokenizer, self.request = model, tokenizer, request
        self.scores, self.prompt_index = scores, prompt_index
        self.on_token: Callable[[float], None] = lambda at: None
        self.cancelled = threading.Event()
        self.started_at = time.perf_counter()

    def start(self) -> None:
        pass  # the request's scoring pass does the work

    def cancel(self) -> None:
        self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[TextPiece]:
        scores = (await self.scores())[self.prompt_index] if self.request.max_new_tokens >= 1 else None
        for piece in await asyncio.to_thread(self._pieces, scores):
            yield piece

    def _pieces(self, scores: PromptScores | None) -> list[TextPiece]:
        """The choice's pieces: its token (if any) picked from the pass's last logits, with its logprobs,
        and decoded. On a worker thread: each step works over the whole vocabulary."""
        request = self.request
        pieces = PieceMaker(self.tokenizer, request.stops, request.max_new_tokens, eos_ids(self.model),
                            request.num_logprobs is not None, request.special_tokens)
        made = []
        if scores is not None:
            prompt = list(request.prompt_ids)
            token = pick_token(request.sampling.processors(len(prompt)), prompt, scores.next_logits)
            self.on_token(time.perf_counter())
            token_scores = None
            if request.num_logprobs is not None:
                logprobs = scores.next_logprobs()
                token_scores = [(float(logprobs[token]), *top_alternatives(logprobs, request.num_logprobs))]
            made.append(pieces.add([token], token_scores))
        return [piece for piece in made if piece is not None] + [pieces.finish()]


class Choice:
    """One choice of the response: its index, and its pieces (the echoed prompt first, if asked)."""

    def __init__(self, index: int, source: Generation | _ScoredChoice,
                 echo: Callable[[], Awaitable[TextPiece]] | None):
        self.index, self.source, self.echo = index, source, echo

    async def pieces(self) -> AsyncIterator[TextPiece]:
        shift = 0
        if self.echo is not None:
            echoed = await self.echo()
            shift = len(echoed.text)
            yield echoed
        async for piece in self.source:
            yield piece.shifted(shift)


class RequestChoices:
    """Every choice of a request: prompts x n, indexed prompt by prompt (prompt p's choices are
    p*n .. p*n + n-1, as OpenAI orders them)."""

    def __init__(self, state, prompts: Sequence[Sequence[int]], body, echo: bool, grammar: Grammar | None = None,
                 special_tokens: bool = False):
        self.state, self.prompts = state, [list(prompt) for prompt in prompts]
        num_logprobs, max_new_tokens = body.num_logprobs, body.max_new_tokens
        self.prompt_scores_needed = echo and num_logprobs is not None
        self.scoring_pass_needed = self.prompt_scores_needed or max_new_tokens == 1
        self.num_logprobs = num_logprobs
        self._scores: asyncio.Future | None = None
        self._scoring = Cancellation()  # of the scoring pass, shared by the choices
        self._echoes: dict[int, asyncio.Future] = {}  # prompt index -> its echoed piece
        self.choices: list[Choice] = []
        for prompt_index, prompt in enumerate(self.prompts):
            for choice in range(body.n):
                request = GenerationRequest(tuple(prompt), max_new_tokens, body.sampling(choice, grammar),
                                            body.stop_sequences, num_logprobs, special_tokens)
                self.choices.append(Choice(len(self.choices), self._source(request, prompt_index, max_new_tokens),
                                           self._echo(prompt_index) if echo else None))

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    def _source(self, request: GenerationRequest, prompt_index: int, max_new_tokens: int):
        state = self.state
        if max_new_tokens <= 1:
            return _ScoredChoice(state.model, state.tokenizer, request, self._prompt_scores, prompt_index)
        return Generation(state.model, state.tokenizer, request, state.pool)

    async def _prompt_scores(self) -> list[PromptScores]:
        return await asyncio.shield(self._scores)  # shared: one reader that stops does not cancel it for all

    def _echo(self, prompt_index: int) -> Callable[[], Awaitable[TextPiece]]:
        """The echoed prompt, made once for the n choices of a prompt, off the event loop (naming a long
        prompt's tokens and their alternatives decodes thousands of short token lists)."""
        async def piece() -> TextPiece:
            if prompt_index not in self._echoes:
                self._echoes[prompt_index] = asyncio.ensure_future(self._echo_piece(prompt_index))
                self._echoes[prompt_index].add_done_callback(retrieve_exception)
            return await asyncio.shield(self._echoes[prompt_index])

        return piece

    async def _echo_piece(self, prompt_index: int) -> TextPiece:
        prompt, tokenizer = self.prompts[prompt_index], self.state.tokenizer
        if not self.prompt_scores_needed:
            return await asyncio.to_thread(echo_piece, tokenizer, prompt)
        scores: PromptScores = (await self._prompt_scores())[prompt_index]
        return await asyncio.to_thread(echo_piece, tokenizer, prompt, scores.token_logprobs, scores.top)

    def start(self) -> None:
        """Start the scoring pass (if any) and every generation."""
        state = self.state
        if self.scoring_pass_needed:
            pad_token_id = state.tokenizer.pad_token_id
            pad_token_id = pad_token_id if pad_token_id is not None else state.tokenizer.eos_token_id or 0
            self._scores = asyncio.get_running_loop().run_in_executor(state.pool, self._score, pad_token_id)
            self._scores.add_done_callback(retrieve_exception)  # a request whose client left never awaits it
        for choice in self.choices:
            choice.source.start()

    def _score(self, pad_token_id: int) -> list[PromptScores]:
        """The scoring pass, on a generation thread; cancel() cancels its forward through the swarm."""
        if self._scoring.is_set():  # the client left while the request waited for a thread
            raise CallCancelledError("the request was cancelled before its scoring pass started")
        state = self.state
        with state.model.client.runtime.cancellable(self._scoring):
            return score_prompts(state.model, self.prompts, self.num_logprobs or 0, pad_token_id,
                                 self.prompt_scores_needed, state.metrics.scoring_passes.labels(state.model_id).inc)

    def cancel(self) -> None:
        """Stop every choice and the scoring pass, wherever they are (safe at any time, and again)."""
        self._scoring.cancel()
        for choice in self.choices:
            choice.source.cancel()


async def interleave(iterators: Sequence[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index, item) of several async iterators as their items come; an iterator's error is raised."""
    pending = {asyncio.ensure_future(anext(iterator)): index for index, iterator in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield index, item
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
    finally:
        for task in pending:
            task.cancel()
