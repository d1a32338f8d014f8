"""Speculative decoding through the swarm, on transformers' own assisted generation.

A draft (a small local model, or prompt lookup) proposes tokens; the swarm checks them all in
one step through the chain; the servers' caches roll back in place past the first rejection.
The tokens must be those of plain greedy decoding, and of transformers on one machine.
"""

import copy
import signal

import pytest
import torch
from transformers import BloomForCausalLM, LogitsProcessorList

from bloompeer.peer.client.inference_session import InferenceSession
from bloompeer.peer.cli.default_model import write_random_checkpoint

from .conftest import AtCall, swarm_client

PROMPT = torch.tensor([[1, 60, 61, 62, 63, 64]])
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def lively_checkpoint(tmp_path_factory):
    """Random weights large enough (std 0.2) that the next token depends on the context, so that a
    draft is sometimes right and sometimes wrong (at the default std both just repeat the last token)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("lively"), num_blocks=4, hidden_size=64, num_heads=4,
                                   seed=3, initializer_range=0.2)


@pytest.fixture(scope="module")
def target(lively_checkpoint) -> BloomForCausalLM:
    return BloomForCausalLM.from_pretrained(lively_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft_model(target) -> BloomForCausalLM:
    """The target's first two blocks (an early-exit draft): it agrees with the target on most tokens."""
    draft = copy.deepcopy(target)
    draft.transformer.h = draft.transformer.h[:2]
    draft.config.n_layer = 2
    return draft


@pytest.fixture
def rollbacks(monkeypatch) -> list[tuple[int, int]]:
    """(from, to) for every rollback of a session's cache during the test."""
    seen, rewind = [], InferenceSession.rewind

    def recording(session, position):
        if position < session.position:
            seen.append((session.position, position))
        return rewind(session, position)

    monkeypatch.setattr(InferenceSession, "rewind", recording)
    return seen


def _greedy(model, **kwargs) -> list[list[int]]:
    with torch.inference_mode():
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs).tolist()


def test_speculative_decoding_is_exact(swarm, start_servers, lively_checkpoint, target, draft_model, rollbacks):
    """Greedy with a draft model, with the target as its own draft, and with prompt lookup: the
    tokens of plain greedy, and of transformers; sampling follows transformers' speculative sampling."""
    start_servers([(0, 2), (2, 4)], model=lively_checkpoint)
    expected = _greedy(target)
    with swarm_client(swarm, lively_checkpoint) as model:
        assert _greedy(model) == expected
        for how, kwargs in [("draft-model", dict(assistant_model=draft_model)),
                            ("target-as-draft", dict(assistant_model=target)),
                            ("prompt-lookup", dict(prompt_lookup_num_tokens=4))]:
            rollbacks.clear()
            assert _greedy(model, **kwargs) == expected, how
            if how == "target-as-draft":
                assert rollbacks == [], "every proposal of the target itself is accepted"
            else:  # some proposals were rejected, some after others were accepted: partial rollbacks
                assert rollbacks, how
        sampling = dict(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8, assistant_model=draft_model)
        with torch.inference_mode():
            torch.manual_seed(5)
            ours = model.generate(PROMPT, **sampling)
            torch.manual_seed(5)
            theirs = target.generate(PROMPT, **sampling)
        assert ours.tolist() == theirs.tolist()


def test_rollback_and_replay_together(swarm, start_servers, lively_checkpoint, target, draft_model, rollbacks):
    """The route's first server is killed mid-generation, after rollbacks: the replay to its
    replacement sends only what was kept, and the tokens stay exact."""
    servers = start_servers([(0, 2), (2, 4), (0, 2)], model=lively_checkpoint)
    with swarm_client(swarm, lively_checkpoint) as model:
        def kill_first():
            first = model.active_session.route[0].peer_id_str
            next(s for s in servers if s.peer_id_str == first).signal(signal.SIGKILL)

        tokens = _greedy(model, assistant_model=draft_model,
                         logits_processor=LogitsProcessorList([AtCall(12, kill_first)]))
    assert rollbacks
    assert tokens == _greedy(target)
