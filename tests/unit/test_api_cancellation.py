"""A request whose HTTP client left is cancelled where its work is: the forward of its scoring pass
and the step of each generation stop on the client's loop (a step can wait minutes for servers of
missing blocks), and a generation still closes its session on the way out."""

from __future__ import annotations

import pytest

from bloompeer.peer.api.choices import RequestChoices
from bloompeer.peer.api.generation import Generation, GenerationRequest
from bloompeer.peer.api.openai_schema import CompletionRequest
from bloompeer.peer.client.errors import CallCancelledError
from bloompeer.peer.client.runtime import ClientRuntime

from .api_fakes import FakeModel, LetterTokenizer, SwarmWork, api_state, in_thread

WAIT_S = 30.0  # only reached when something hangs


@pytest.fixture
def runtime():
    runtime = ClientRuntime()
    yield runtime
    runtime.shutdown()


async def test_cancelling_a_request_cancels_its_scoring_pass_on_the_client_loop(runtime):
    work = SwarmWork().hold()
    state = api_state(FakeModel(runtime, work), LetterTokenizer())
    body = CompletionRequest(model="fake", prompt=[[1, 2, 3]], max_tokens=0, echo=True, logprobs=1)
    choices = RequestChoices(state, body.prompt, body, echo=True)
    choices.start()
    first_piece = anext(choices.choices[0].pieces())
    assert await in_thread(lambda: work.started.wait(WAIT_S))

    choices.cancel()
    assert await in_thread(lambda: work.cancelled.wait(WAIT_S)), "the forward went on through the swarm"
    with pytest.raises(CallCancelledError):
        await first_piece


async def test_cancelling_a_generation_cancels_its_step_and_still_closes_its_session(runtime):
    work = SwarmWork().hold()
    state = api_state(FakeModel(runtime, work), LetterTokenizer())
    generation = Generation(state.model, state.tokenizer, GenerationRequest((1, 2), max_new_tokens=100), state.pool)
    generation.start()
    pieces = aiter(generation)
    assert await in_thread(lambda: work.started.wait(WAIT_S))

    generation.cancel()
    assert await in_thread(lambda: work.cancelled.wait(WAIT_S)), "the step went on through the swarm"
    assert await in_thread(lambda: work.closed.wait(WAIT_S)), "the session was not closed"
    with pytest.raises(CallCancelledError):
        await anext(pieces)
