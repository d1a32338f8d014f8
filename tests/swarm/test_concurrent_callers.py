"""One model object called from many threads at once, as a server program (the HTTP API) does.

Each call keeps its own session: none can use, close or corrupt another's, and every output is
what the same call gives alone (and what transformers gives on one machine).
"""

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .conftest import swarm_client

THREADS = 16
NEW_TOKENS = 12


def _prompts() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(4, 200, (1, 3 + i % 5), generator=generator) for i in range(THREADS)]


def _all_at_once(count: int, call):
    """Run call(i) for i < count in as many threads, released together; results in order."""
    barrier = threading.Barrier(count)

    def run(i):
        barrier.wait()
        return call(i)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))


@torch.inference_mode()
def test_sixteen_threads_generating_on_one_model(start_servers, fresh_model, swarm, reference_model, caplog):
    start_servers([(0, 4)])
    prompts = _prompts()
    expected = [reference_model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False).tolist() for p in prompts]
    with swarm_client(swarm, fresh_model) as model:
        alone = [model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False).tolist() for p in prompts]
        with caplog.at_level(logging.WARNING, logger="bloompeer"):
            together = _all_at_once(THREADS, lambda i: model.generate(
                prompts[i], max_new_tokens=NEW_TOKENS, do_sample=False).tolist())
        assert model.client.swarm.bans.banned() == set()
    assert alone == expected
    assert together == expected
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@torch.inference_mode()
def test_each_thread_keeps_its_own_inference_session(model, reference_model):
    """Two threads each continue their own kept session; neither sees nor closes the other's."""
    prompts = _prompts()[:2]

    def continue_twice(i):
        with model.inference_session(max_length=32) as session:
            assert model.active_session is session
            first = model.generate(prompts[i], max_new_tokens=4, do_sample=False)
            second = model.generate(first, max_new_tokens=4, do_sample=False)
        assert model.active_session is None
        return session, second.tolist()

    (session_a, tokens_a), (session_b, tokens_b) = _all_at_once(2, continue_twice)
    assert session_a is not session_b
    assert model.active_session is None  # nothing leaked into the calling thread
    for prompt, tokens in zip(prompts, (tokens_a, tokens_b)):
        assert tokens == reference_model.generate(prompt, max_new_tokens=8, do_sample=False).tolist()
