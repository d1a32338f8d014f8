"""The scheduler keeps sessions that step together in one pass: before a pass it waits, briefly, for
the sessions of the previous pass that have not sent their next step yet."""

import asyncio

import pytest
import torch

from bloompeer.p2p import Step
from bloompeer.peer.server import scheduler as scheduler_module
from bloompeer.peer.server.scheduler import Scheduler

from .conftest import SPAN_CONFIG as CONFIG


def _step(cache):
    return Step(cache.length, torch.randn(1, 1, CONFIG.hidden_size))


async def _round(scheduler, caches, stagger_s):
    """One step of every session, each sent `stagger_s` after the previous one."""
    steps = []
    for number, cache in enumerate(caches):
        steps.append(asyncio.ensure_future(scheduler.step(f"session-{number}", cache, _step(cache))))
        if stagger_s:
            await asyncio.sleep(stagger_s)
    return await asyncio.gather(*steps)


@pytest.mark.parametrize("max_batch_sessions, passes", [(None, 1), (1, 3)], ids=["batching", "batching-off"])
async def test_staggered_steps_of_the_previous_pass_share_the_next(span, compute, monkeypatch, max_batch_sessions,
                                                                   passes):
    monkeypatch.setattr(scheduler_module, "GATHER_SHARE", 5000)  # waits of seconds: the order alone decides
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32,
                          max_batch_sessions=max_batch_sessions)
    runner = asyncio.create_task(scheduler.run())
    try:
        caches = [span.new_cache(0, 2, 1, 16, torch.float32) for _ in range(3)]
        await _round(scheduler, caches, 0.0)  # sent together
        assert scheduler.batches_run == 3 if max_batch_sessions == 1 else 1
        before = scheduler.batches_run
        outputs = await _round(scheduler, caches, 0.05)  # back one by one, as through their clients
        assert scheduler.batches_run - before == passes
        assert all(cache.length == 2 for cache in caches)
        assert all(output.shape == (1, 1, CONFIG.hidden_size) for output in outputs)
    finally:
        runner.cancel()


async def test_a_session_that_does_not_come_back_delays_the_others_only_briefly(span, compute):
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32)
    runner = asyncio.create_task(scheduler.run())
    try:
        gone, staying = (span.new_cache(0, 2, 1, 16, torch.float32) for _ in range(2))
        await asyncio.gather(scheduler.step("gone", gone, _step(gone)),
                             scheduler.step("staying", staying, _step(staying)))
        for _ in range(3):  # `gone` never steps again: each wait ends at its deadline
            await asyncio.wait_for(scheduler.step("staying", staying, _step(staying)), 30)
        assert staying.length == 4 and gone.length == 1
    finally:
        runner.cancel()
