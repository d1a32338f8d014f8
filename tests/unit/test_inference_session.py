"""The inference session's own logic, on pretend servers (tests/unit/client_fakes.py): a server
that fails mid-generation is replaced and the new one is given the same steps again, so the
output does not change; a rewind makes the next step overwrite the dropped tokens everywhere,
and a replay after a rewind sends only what is still kept."""

import pytest
import torch

from bloompeer.errors import RequestError
from bloompeer.peer.client import inference_session
from bloompeer.peer.client.config import ClientConfig
from bloompeer.peer.client.inference_session import InferenceSession

from .client_fakes import FakeServers, chain_function, record, swarm_of

CONFIG = ClientConfig(recovery_timeout_s=5.0, missing_blocks_timeout_s=5.0, poll_period_s=0.05)


@pytest.fixture
def servers(monkeypatch):
    servers = FakeServers()
    monkeypatch.setattr(inference_session, "SpanInferenceSession", servers.session_class())
    return servers


def _session(max_length=16):
    """Blocks 0:2 on 'head' (or 'spare', slower), 2:4 on 'tail' (or 'spare-tail', slower)."""
    swarm = swarm_of(record("head", 0, 2), record("spare", 0, 2), record("tail", 2, 4), record("spare-tail", 2, 4),
                     rtts_s={"head": 0.001, "spare": 0.5, "tail": 0.001, "spare-tail": 0.5})
    return InferenceSession(None, swarm, CONFIG, max_length), swarm


def _tokens(n, seed=0):
    return torch.randn(1, n, 1, generator=torch.Generator().manual_seed(seed))


async def test_a_failed_server_is_replaced_and_the_steps_replayed_with_the_same_output(servers):
    session, swarm = _session()
    text = _tokens(6)
    outputs = [await session.step(text[:, :3]), await session.step(text[:, 3:4])]
    assert session.route[0].peer_id_str == "head"
    servers.fail_next["head"] = 1
    outputs += [await session.step(text[:, 4:5]), await session.step(text[:, 5:6])]

    assert [r.peer_id_str for r in session.route] == ["spare", "tail"]
    assert swarm.bans.banned() == {"head"}
    expected = chain_function(text, [(0, 2), (2, 4)])
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=0, atol=1e-6)
    replayed = servers.received["spare"]  # the kept steps, as first sent, then the failed one and the next
    assert [(s.position, s.hidden.shape[1]) for s in replayed] == [(0, 3), (3, 1), (4, 1), (5, 1)]
    torch.testing.assert_close(replayed[0].hidden, text[:, :3])
    assert [r.peer_id_str for r in servers.closed] == ["head"]


async def test_a_rewind_is_overwritten_by_the_next_step_and_a_later_replay_sends_only_what_is_kept(servers):
    session, _ = _session()
    text, other = _tokens(5, seed=1), _tokens(2, seed=2)
    await session.step(text[:, :4])
    session.rewind(2)  # e.g. a speculative draft rejected after two tokens
    assert session.position == 2
    rewritten = await session.step(other)  # positions 2 and 3 again, with other tokens
    kept = torch.cat([text[:, :2], other], dim=1)
    torch.testing.assert_close(rewritten, chain_function(kept, [(0, 2), (2, 4)])[:, 2:], rtol=0, atol=1e-6)

    servers.fail_next["tail"] = 1
    last = await session.step(text[:, 4:5])
    # the replacement got the first step cut to its first 2 tokens, the rewritten step, then the new one
    assert [(s.position, s.hidden.shape[1]) for s in servers.received["spare-tail"]] == [(0, 2), (2, 2), (4, 1)]
    sequence = torch.cat([kept, text[:, 4:5]], dim=1)
    torch.testing.assert_close(last, chain_function(sequence, [(0, 2), (2, 4)])[:, 4:], rtol=0, atol=1e-6)


async def test_a_replay_after_a_rewind_gives_the_same_output_as_without_the_fault(servers):
    session, _ = _session()
    text, other = _tokens(6, seed=4), _tokens(1, seed=5)
    await session.step(text[:, :5])
    session.rewind(3)
    await session.step(other)
    servers.fail_next["head"] = 1
    last = await session.step(text[:, 5:6])
    sequence = torch.cat([text[:, :3], other, text[:, 5:6]], dim=1)
    torch.testing.assert_close(last, chain_function(sequence, [(0, 2), (2, 4)])[:, 4:], rtol=0, atol=1e-6)
    assert [(s.position, s.hidden.shape[1]) for s in servers.received["spare"]] == [(0, 3), (3, 1), (4, 1)]


async def test_steps_that_do_not_fit_the_session_are_the_callers_to_fix(servers):
    session, swarm = _session(max_length=4)
    await session.step(_tokens(3))
    with pytest.raises(RequestError, match="max_length=4"):
        await session.step(_tokens(2))
    with pytest.raises(RequestError, match="batch 1"):
        await session.step(torch.zeros(2, 1, 1))
    with pytest.raises(RequestError, match="rewind to 5"):
        session.rewind(5)
    assert swarm.bans.banned() == set() and servers.closed == []
