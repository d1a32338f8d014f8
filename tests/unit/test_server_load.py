"""The server's cache budget, session registry and scheduler, without processes or network."""

import asyncio

import pytest
import torch

from bloompeer.blocks import SessionCache
from bloompeer.p2p import ErrorCode, ProtocolError, Step
from bloompeer.peer.server.cache_budget import CacheBudget
from bloompeer.peer.server.scheduler import Scheduler
from bloompeer.peer.server.sessions import SessionRegistry

from .conftest import SPAN_CONFIG as CONFIG


async def _until(condition, timeout_s: float = 60.0) -> None:
    """Wait until condition() holds, looking again every few milliseconds (no fixed sleep)."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.002)
    await asyncio.wait_for(poll(), timeout_s)


async def test_budget_waits_for_room_then_refuses_with_numbers():
    budget = CacheBudget(total_bytes=100, bytes_per_token=10)
    await budget.reserve(60, timeout_s=0)
    assert budget.tokens_left == 4
    with pytest.raises(ProtocolError) as info:
        await budget.reserve(50, timeout_s=0.05)
    assert info.value.code is ErrorCode.BUSY and "asked for 5 tokens" in str(info.value) and "4 of 10" in str(info.value)
    waiting = asyncio.create_task(budget.reserve(50, timeout_s=600))  # a guard: room comes when released
    await _until(lambda: budget.waiting == 1)
    assert not waiting.done()
    await budget.release(60)
    await asyncio.wait_for(waiting, 30)
    assert budget.tokens_left == 5
    with pytest.raises(ProtocolError) as info:
        await budget.reserve(1000, timeout_s=5)  # can never fit: no waiting
    assert info.value.code is ErrorCode.TOO_LARGE


async def test_registry_limits_sessions_per_peer_and_frees_on_close_and_expiry(span):
    budget = CacheBudget(total_bytes=1000, bytes_per_token=10)
    registry = SessionRegistry(budget, max_sessions_per_peer=2, session_timeout_s=0.2)
    expired = []

    def make_cache():
        return span.new_cache(0, 2, 1, 4, torch.float32)

    async def deliver(message):
        pass

    first = await registry.open("peer-a", 100, 0, make_cache, lambda: expired.append("first"), deliver)
    await registry.open("peer-a", 100, 0, make_cache, lambda: expired.append("second"), deliver)
    with pytest.raises(ProtocolError) as info:
        await registry.open("peer-a", 100, 0, make_cache, lambda: None, deliver)
    assert info.value.code is ErrorCode.BUSY
    await registry.open("peer-b", 100, 0, make_cache, lambda: None, deliver)  # other peers are not affected
    assert registry.find(first.id) is first
    await registry.close(first)
    await registry.close(first)  # idempotent
    assert registry.find(first.id) is None
    assert budget.used_bytes == 200
    reaper = asyncio.create_task(registry.expire_idle())
    try:
        await _until(lambda: not registry.sessions)
    finally:
        reaper.cancel()
    assert expired == ["second"] and budget.used_bytes == 0 and not registry.sessions


async def test_a_session_whose_step_is_under_way_is_not_idle(span):
    """However long a step waits (here: its session's stepping lock held), its session is not closed
    as idle; an idle one opened after it is, by the same look of the reaper."""
    budget = CacheBudget(total_bytes=1000, bytes_per_token=10)
    registry = SessionRegistry(budget, max_sessions_per_peer=2, session_timeout_s=0.2)
    expired = asyncio.Event()

    async def deliver(message):
        pass

    def make_cache():
        return span.new_cache(0, 2, 1, 4, torch.float32)

    stepping = await registry.open("peer-a", 100, 0, make_cache, lambda: None, deliver)
    await stepping.stepping.acquire()
    idle = await registry.open("peer-a", 100, 0, make_cache, expired.set, deliver)
    reaper = asyncio.create_task(registry.expire_idle())
    try:
        await asyncio.wait_for(expired.wait(), 60)
        assert registry.sessions == {stepping}  # idle longer than `idle`, yet kept
        stepping.stepping.release()
        stepping.touch()
    finally:
        reaper.cancel()


def _session(span, batch, cached):
    cache = span.new_cache(span.start, span.end, batch, 64, torch.float32)
    if cached:
        with torch.inference_mode():
            span(torch.randn(batch, cached, CONFIG.hidden_size), cache.begin_step(0, None, cached), cache)
    return cache


async def test_concurrent_steps_run_as_one_batch_with_the_same_results(span, compute):
    """Steps queued together (here: all before the scheduler first looks) run as one pass."""
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32)
    runner = None
    try:
        torch.manual_seed(1)
        caches = [_session(span, batch=1, cached=3 + i) for i in range(8)]
        steps = [Step(cache.length, torch.randn(1, 1, CONFIG.hidden_size)) for cache in caches]
        torch.manual_seed(1)
        references = [_session(span, batch=1, cached=3 + i) for i in range(8)]
        with torch.inference_mode():
            expected = [span(s.hidden, c.begin_step(s.position, None, 1), c) for c, s in zip(references, steps)]
        outputs = asyncio.gather(*(scheduler.step(f"s{i}", c, s) for i, (c, s) in enumerate(zip(caches, steps))))
        await _until(lambda: scheduler.queue_depth == 8)
        runner = asyncio.create_task(scheduler.run())
        outputs = await outputs
        assert scheduler.batches_run == 1 and scheduler.requests_run == 8
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        if runner is not None:
            runner.cancel()


async def test_batches_respect_max_batch_tokens_and_inference_goes_first(span, compute, monkeypatch):
    scheduler = Scheduler(span, compute, max_batch_tokens=8, device="cpu", dtype=torch.float32)
    passes = []
    original = span.forward_segments

    def recording(segments, start=None, end=None):
        passes.append(sum(s.hidden.shape[0] * s.hidden.shape[1] for s in segments))
        return original(segments, start, end)

    monkeypatch.setattr(span, "forward_segments", recording)
    runner = None
    try:
        order = []

        async def tracked(name, awaitable):
            await awaitable
            order.append(name)

        caches = [_session(span, batch=3, cached=0) for _ in range(4)]
        jobs = [tracked("forward", scheduler.forward(torch.randn(1, 4, 32), None, 0, 2))]
        jobs += [tracked(f"step{i}", scheduler.step(f"s{i}", c, Step(0, torch.randn(3, 1, 32))))
                 for i, c in enumerate(caches)]
        jobs = asyncio.gather(*jobs)
        await _until(lambda: scheduler.queue_depth == 5)  # all queued before the scheduler looks
        runner = asyncio.create_task(scheduler.run())
        await jobs
        assert max(passes) <= 8  # 4 steps of 3 rows: never 12 in one pass
        assert order.index("forward") == len(order) - 1  # queued first, run last
    finally:
        if runner is not None:
            runner.cancel()


async def test_a_long_prefill_runs_in_chunks_with_the_same_result(span, compute):
    scheduler = Scheduler(span, compute, max_batch_tokens=8, device="cpu", dtype=torch.float32)
    runner = asyncio.create_task(scheduler.run())
    try:
        hidden = torch.randn(2, 13, CONFIG.hidden_size)  # 26 rows: 4 chunks of at most 4 tokens x 2 rows
        prompts = torch.randn(span.num_blocks, 2, 6, CONFIG.hidden_size)  # deep prompts over 2 of the chunks
        chunked = await scheduler.step("s", _session(span, 2, 0), Step(0, hidden, prompts=prompts))
        with torch.inference_mode():
            whole = span(hidden, None, prompts=prompts)
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)
        with pytest.raises(ProtocolError) as info:
            await scheduler.step("t", _session(span, 9, 0), Step(0, torch.randn(9, 1, 32)))  # 9 rows > 8 per pass
        assert info.value.code is ErrorCode.TOO_LARGE
    finally:
        runner.cancel()


class _BrokenCache(SessionCache):
    def update(self, layer_idx, *new):
        raise RuntimeError("boom")


async def test_a_failing_request_in_a_batch_fails_alone(span, compute):
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32)
    runner = None
    try:
        good = _session(span, 1, 2)
        bad = _BrokenCache(span.cache_layouts(0, 2), 0, 2, 1, 8, torch.float32)
        results = asyncio.gather(scheduler.step("good", good, Step(2, torch.randn(1, 1, 32))),
                                 scheduler.step("bad", bad, Step(0, torch.randn(1, 1, 32))), return_exceptions=True)
        await _until(lambda: scheduler.queue_depth == 2)  # both in one pass
        runner = asyncio.create_task(scheduler.run())
        ok, error = await results
        assert scheduler.batches_run == 1
        assert isinstance(ok, torch.Tensor) and good.length == 3
        assert isinstance(error, RuntimeError) and bad.length == 0  # rolled back
    finally:
        if runner is not None:
            runner.cancel()
