"""Serving a hybrid model's sessions (Qwen3-Next's Gated DeltaNet blocks beside attention): the cache budget,
the announced room and the memory plan count a session's recurrent state once per session, not as a token
(the per-token count would have made every token cost a whole state); a rewind that the state cannot
make is refused as `unsupported` (the client replays elsewhere) and leaves the session as it was."""

import pytest
import torch

from bloompeer.blocks import open_checkpoint
from bloompeer.blocks.kv_cache import CacheLayout
from bloompeer.blocks.recurrent_state import RecurrentLayout
from bloompeer.p2p import ErrorCode, OpenSession, ProtocolError, Step
from bloompeer.peer.server import memory_plan
from bloompeer.peer.server.cache_budget import CacheBudget
from bloompeer.peer.server.config import ServerConfig
from bloompeer.peer.server.memory_plan import plan_memory
from bloompeer.peer.server.metrics import ServerMetrics
from bloompeer.peer.server.span_service import SpanService

MIB = 2**20


@pytest.fixture(scope="module")
def span(qwen3_next_checkpoint):
    return open_checkpoint(qwen3_next_checkpoint).load_span(0, 4, torch.float32)


def _layouts(span):
    layouts = span.cache_layouts(0, 4)
    recurrent = [layout for layout in layouts if isinstance(layout, RecurrentLayout)]
    attention = [layout for layout in layouts if isinstance(layout, CacheLayout)]
    return recurrent, attention


def test_a_sessions_state_costs_per_session_and_its_tokens_per_token(span):
    recurrent, attention = _layouts(span)
    per_token, per_session = span.cache_costs(0, 4, torch.float32)
    assert (len(recurrent), len(attention)) == (3, 1)
    assert per_token == attention[0].nbytes_per_token(torch.float32) + 1  # keys, values and the padding mask
    assert per_session == 3 * recurrent[0].nbytes(1, torch.float32)
    for batch, length in ((1, 10), (1, 1000), (3, 50)):
        assert span.cache_nbytes(0, 4, batch, length, torch.float32) == batch * (length * per_token + per_session)


async def test_the_budget_announces_tokens_after_one_sessions_state(span, compute):
    per_token, per_session = span.cache_costs(0, 4, torch.float32)
    total = per_session + 100 * per_token
    service = SpanService(span, "m", ServerConfig(model="m", start=0, end=4), total, compute, ServerMetrics(),
                          accepting=lambda: True)
    try:
        assert service.budget.tokens_left == 100  # a state counted as a token would announce total // (state + token)

        async def deliver(message):
            pass

        session = await service.backend.open_session("peer", OpenSession("m", 0, 4, 1, 100), lambda: None, deliver)
        assert service.budget.used_bytes == total and service.budget.tokens_left == 0  # it fits exactly
        hidden = torch.randn(1, 6, span.config.hidden_size)
        await service.backend.step(session, Step(0, hidden[:, :4]))
        await service.backend.step(session, Step(4, hidden[:, 4:6]))
        with pytest.raises(ProtocolError) as info:  # before the last step: the state cannot go back there
            await service.backend.step(session, Step(2, hidden[:, 2:3]))
        assert info.value.code is ErrorCode.UNSUPPORTED and "replay" in str(info.value)
        expected = _last_output(span, hidden, [(0, 4), (4, 1), (5, 1)])  # the draft at 5 rejected
        output = await service.backend.step(session, Step(5, hidden[:, 5:6]))  # a rollback within the last step
        torch.testing.assert_close(output, expected, rtol=0, atol=1e-5)
    finally:
        await service.retire()


async def test_the_budget_of_recurrent_blocks_alone_is_said_in_sessions_not_tokens(span):
    """Blocks 0:3 are all Gated DeltaNet: a token costs its padding-mask byte alone, so the start-up log and a
    refusal speak of sessions' state in MiB, not of billions of tokens; beside an attention block, of both."""
    per_token, per_session = span.cache_costs(0, 3, torch.float32)
    assert per_token == 1
    budget = CacheBudget(4 * per_session, per_token, per_session)
    assert budget.room() == f"4 one-row sessions' recurrent state ({per_session / MIB:.2f} MiB each)"
    with pytest.raises(ProtocolError, match=r"asked for [\d.]+ MiB of session state, [\d.]+ of [\d.]+ MiB are free"):
        await budget.reserve(5 * per_session, timeout_s=0)
    total = per_session + 100 * 4097
    mixed = CacheBudget(total, 4097, per_session)
    assert mixed.room().startswith(f"100 tokens, or {total // per_session} one-row sessions' recurrent state")
    assert CacheBudget(100 * 4097, 4097).room() == "100 tokens"


def _last_output(span, hidden, steps):
    """The last of `steps` (position, tokens) of `hidden` through a fresh session's cache."""
    cache = span.new_cache(0, 4, 1, 16, torch.float32)
    with torch.no_grad():
        for position, num_new in steps:
            output = span(hidden[:, position:position + num_new], cache.begin_step(position, None, num_new), cache)
    return output


def test_the_memory_plan_counts_tokens_per_token_and_reserves_a_sessions_state(qwen3_next_checkpoint, span,
                                                                               monkeypatch):
    monkeypatch.setattr(memory_plan, "rss_bytes", lambda: 100 * MIB)
    monkeypatch.setattr(memory_plan, "available_bytes", lambda device: 1000 * MIB)
    checkpoint = open_checkpoint(qwen3_next_checkpoint)
    config = ServerConfig(model=str(qwen3_next_checkpoint), start=None, end=None, cache_tokens=64)
    plan = plan_memory(config, checkpoint, 4)
    recurrent, attention = _layouts(span)
    # any 4 blocks, counted as if each were an attention block for its tokens and a recurrent one for its state
    assert plan.cache_bytes == 64 * (4 * attention[0].nbytes_per_token(torch.float32) + 1) \
        + 4 * recurrent[0].nbytes(1, torch.float32)
    assert CacheBudget(plan.cache_bytes, *span.cache_costs(0, 4, torch.float32)).tokens_left >= 64
