"""The scheduler keeps sessions that step together in one pass: before a pass it waits, briefly, for
the sessions of the previous pass that have not sent their next step yet; and with a batch wait
(`serve --batch-wait`), up to that long for the pass to fill, whoever's steps fill it.

The waits' deadlines are set beyond anything a test takes, or short where a pass must not fill: what
is asserted follows from the order in which steps arrive, never from how fast the machine is."""

import asyncio

import pytest
import torch

from bloompeer.p2p import ProtocolError, Step
from bloompeer.peer.server import scheduler as scheduler_module
from bloompeer.peer.server.scheduler import Scheduler

from .conftest import SPAN_CONFIG as CONFIG


def _step(cache):
    return Step(cache.length, torch.randn(1, 1, CONFIG.hidden_size))


async def _round(scheduler, caches, staggered):
    """One step of every session; staggered: each sent once the previous one's has been queued and the
    scheduler has had the chance to start a pass with what was there (as steps come back through
    their clients, one by one)."""
    steps = []
    for number, cache in enumerate(caches):
        steps.append(asyncio.ensure_future(scheduler.step(f"session-{number}", cache, _step(cache))))
        if staggered:
            await _loop_turns()
    return await asyncio.gather(*steps)


async def _loop_turns(turns: int = 20) -> None:
    """Let every task that can run do so, a few times over (no time passes that a test relies on)."""
    for _ in range(turns):
        await asyncio.sleep(0)


@pytest.mark.parametrize("max_batch_sessions, passes", [(None, 1), (1, 3)], ids=["batching", "batching-off"])
async def test_staggered_steps_of_the_previous_pass_share_the_next(span, compute, monkeypatch, max_batch_sessions,
                                                                   passes):
    monkeypatch.setattr(scheduler_module, "GATHER_SHARE", float("inf"))  # no deadline: the order alone decides
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32,
                          max_batch_sessions=max_batch_sessions)
    runner = asyncio.create_task(scheduler.run())
    try:
        caches = [span.new_cache(0, 2, 1, 16, torch.float32) for _ in range(3)]
        await _round(scheduler, caches, staggered=False)  # sent together
        assert scheduler.batches_run == 3 if max_batch_sessions == 1 else 1
        before = scheduler.batches_run
        outputs = await _round(scheduler, caches, staggered=True)  # back one by one, as through their clients
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


async def test_with_a_batch_wait_steps_of_sessions_new_to_the_scheduler_fill_one_pass(span, compute):
    """The first steps of three sessions, sent one by one: with max_batch_sessions 3 and a wait longer
    than any test, the pass starts once the third is in (no earlier pass told the scheduler of them)."""
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32,
                          max_batch_sessions=3, batch_wait_s=3600.0)
    runner = asyncio.create_task(scheduler.run())
    try:
        caches = [span.new_cache(0, 2, 1, 16, torch.float32) for _ in range(3)]
        for _ in range(2):  # the first round, then the next
            await asyncio.wait_for(_round(scheduler, caches, staggered=True), 30)
        assert (scheduler.batches_run, scheduler.requests_run) == (2, 6)
        assert all(cache.length == 2 for cache in caches)
    finally:
        runner.cancel()


async def test_a_pass_that_does_not_fill_runs_once_the_batch_wait_is_over(span, compute):
    """Two sessions' steps, both queued before the scheduler looks, with room for three: the pass waits
    out the (short) batch wait, then runs both together."""
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32,
                          max_batch_sessions=3, batch_wait_s=0.05)
    caches = [span.new_cache(0, 2, 1, 16, torch.float32) for _ in range(2)]
    steps = asyncio.gather(*(scheduler.step(f"session-{number}", cache, _step(cache))
                             for number, cache in enumerate(caches)))
    await _loop_turns()
    assert scheduler.queue_depth == 2
    runner = asyncio.create_task(scheduler.run())
    try:
        await asyncio.wait_for(steps, 30)
        assert (scheduler.batches_run, scheduler.requests_run) == (1, 2)
    finally:
        runner.cancel()


async def test_stopping_ends_a_batch_wait(span, compute):
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32,
                          max_batch_sessions=3, batch_wait_s=3600.0)
    runner = asyncio.create_task(scheduler.run())
    cache = span.new_cache(0, 2, 1, 16, torch.float32)
    waiting = asyncio.ensure_future(scheduler.step("waiting", cache, _step(cache)))
    await _loop_turns()  # queued; the pass waits for two more
    await asyncio.wait_for(scheduler.stop(), 30)
    await asyncio.wait_for(runner, 30)  # run() ends: the wait ended with the stop
    with pytest.raises(ProtocolError):
        await waiting
    assert scheduler.batches_run == 0
