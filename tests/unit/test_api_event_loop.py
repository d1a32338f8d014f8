"""A request's choices compute off the HTTP event loop, those of at most one token (a prompt scored,
with echo and logprobs, or one token picked) and generated ones (whose pieces decode the text so
far): while one is picked and decoded, the loop answers others (/health, say). Shown by order, not
by time: the tokenizer holds the first decode until the event loop has answered something else,
which it can only do if it is not the one decoding; and no decode at all may run on the loop's
thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bloompeer.peer.api.choices import RequestChoices
from bloompeer.peer.api.openai_schema import CompletionRequest
from bloompeer.peer.client.runtime import ClientRuntime

from .api_fakes import FakeModel, LetterTokenizer, SwarmWork, api_state

HOLD_S = 60.0  # how long a decode waits for the loop to answer; only reached when the loop is the one decoding


class LoopWatch:
    """A decode waits here until the event loop has run a callback scheduled once decoding began."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.decoding, self.answered = threading.Event(), threading.Event()
        self.loop_thread = threading.get_ident()  # made on the loop
        threading.Thread(target=self._answer_once_decoding, args=(loop,), daemon=True).start()

    def _answer_once_decoding(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.decoding.wait(HOLD_S):
            loop.call_soon_threadsafe(self.answered.set)  # as the loop would answer GET /health

    def before_decode(self) -> None:
        if threading.get_ident() == self.loop_thread:
            raise AssertionError("a choice was decoded on the event loop's thread")
        self.decoding.set()
        if not self.answered.wait(HOLD_S):
            raise AssertionError("the event loop answered nothing while a choice was decoded: it was decoding")


@pytest.mark.parametrize("request_fields", [
    dict(max_tokens=1, echo=True, logprobs=2),  # a harness's scoring, and the one token's logprobs
    dict(max_tokens=1),  # one token picked from the pass
    dict(max_tokens=0, echo=True),  # the prompt echoed, nothing generated
], ids=["echo-logprobs", "one-token", "echo"])
async def test_choices_of_at_most_one_token_are_picked_and_decoded_off_the_event_loop(request_fields):
    pieces, body = await _pieces_with_a_watched_loop(request_fields)
    text = "".join(piece.text for piece in pieces)
    assert text.startswith("bcd") == body.echo and len(text) == 3 * body.echo + body.max_tokens
    assert pieces[-1].finish_reason is not None


@pytest.mark.parametrize("stream", [False, True])
async def test_generated_choices_are_decoded_off_the_event_loop(stream):
    pieces, _ = await _pieces_with_a_watched_loop(dict(max_tokens=5, stream=stream))
    assert "".join(piece.text for piece in pieces) == "bcdef"
    assert [piece.finish_reason for piece in pieces][-1] == "length" and pieces[-1].completion_tokens == 5


async def _pieces_with_a_watched_loop(request_fields):
    runtime = ClientRuntime()
    watch = LoopWatch(asyncio.get_running_loop())
    state = api_state(FakeModel(runtime, SwarmWork()), LetterTokenizer(watch.before_decode))
    body = CompletionRequest(model="fake", prompt=[[1, 2, 3]], temperature=0, **request_fields)
    choices = RequestChoices(state, body.prompt, body, echo=body.echo)
    try:
        choices.start()
        pieces = [piece async for piece in choices.choices[0].pieces()]
    finally:
        runtime.shutdown()
    assert watch.answered.is_set()
    return pieces, body
