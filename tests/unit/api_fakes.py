"""Stand-ins for the API's model and tokenizer at the unit level: a model whose every forward (and
every generation step) is a call on a real client runtime, as the swarm's blocks are, doing
whatever work the test gives it; and a tokenizer of one letter per token."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from bloompeer.peer.api.metrics import ApiMetrics
from bloompeer.peer.client.runtime import ClientRuntime

VOCAB = 8  # token 0 is the end of text


class LetterTokenizer:
    """Token i reads as the letter 'a' + i; token 0 is special (<eos>). `before_decode` runs first
    in every decode (where a test can hold it)."""

    pad_token_id = eos_token_id = 0
    all_special_ids = [0]

    def __init__(self, before_decode: Callable[[], None] = lambda: None):
        self.before_decode = before_decode

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        self.before_decode()
        return "".join(chr(ord("a") + i) for i in token_ids if i != 0 or not skip_special_tokens)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return "<eos>" if token_id == 0 else chr(ord("a") + token_id)


class SwarmWork:
    """What each forward or step does on the client's loop: by default nothing; `hold()` makes it wait
    there until cancelled, noting when it started and that it was cancelled."""

    def __init__(self):
        self.holding = False
        self.started, self.cancelled, self.closed = threading.Event(), threading.Event(), threading.Event()

    def hold(self) -> SwarmWork:
        self.holding = True
        return self

    async def __call__(self) -> None:
        if not self.holding:
            return
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def close_session(self) -> None:
        self.closed.set()


class FakeModel:
    """Logits of a seeded generator; each forward, and each step of generate(), is runtime.run(work())
    and generate() closes its "session" as the real model does (cancellable=False, in a finally)."""

    def __init__(self, runtime: ClientRuntime, work: SwarmWork):
        self.client, self.work = SimpleNamespace(runtime=runtime), work
        self.config = SimpleNamespace(vocab_size=VOCAB)
        self.generation_config = SimpleNamespace(eos_token_id=0)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        self.client.runtime.run(self.work())
        generator = torch.Generator().manual_seed(0)
        return SimpleNamespace(logits=torch.randn(*input_ids.shape, VOCAB, generator=generator))

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, streamer, stopping_criteria, **kwargs):
        streamer.put(input_ids)
        try:
            for step in range(max_new_tokens):
                self.client.runtime.run(self.work())
                if bool(stopping_criteria(input_ids, None).any()):
                    break
                streamer.put(torch.tensor([1 + step % (VOCAB - 1)]))
        finally:
            self.client.runtime.run(self.work.close_session(), cancellable=False)


def api_state(model: FakeModel, tokenizer: LetterTokenizer) -> SimpleNamespace:
    """What RequestChoices reads of the app's ApiState."""
    return SimpleNamespace(model=model, tokenizer=tokenizer, pool=ThreadPoolExecutor(2), metrics=ApiMetrics(),
                           model_id="fake")


async def in_thread(wait: Callable[[], bool]) -> bool:
    """A blocking wait (an Event's), off the event loop."""
    return await asyncio.to_thread(wait)
