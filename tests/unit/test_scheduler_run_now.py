"""A lone session's short step runs on the event loop's own thread, skipping the hand-offs to the
compute thread and back; anything else (another session's work waiting or running, a previous pass
shared with other sessions or too long, a batch wait, a caller that is not the serial thread) goes
through the compute thread as before. Which thread ran a pass is what is asserted, never a time."""

import asyncio
import threading

import pytest
import torch

from bloompeer.p2p import Step
from bloompeer.peer.server import scheduler as scheduler_module
from bloompeer.peer.server.compute import ComputeWorker
from bloompeer.peer.server.scheduler import Scheduler

from .conftest import SPAN_CONFIG as CONFIG


@pytest.fixture
def serial_compute():
    """One torch thread per pass (so the choice of threads cannot depend on the machine), made serial
    on the test's event loop thread as a server's loop is."""
    worker = ComputeWorker(max_threads=1)
    worker.make_caller_serial()
    yield worker
    worker.shutdown()


@pytest.fixture
def pass_threads(span, monkeypatch):
    """The thread each pass through the span ran on."""
    threads = []
    forward_segments = span.forward_segments

    def recorded(*args, **kwargs):
        threads.append(threading.get_ident())
        return forward_segments(*args, **kwargs)

    monkeypatch.setattr(span, "forward_segments", recorded)
    return threads


def _step(cache):
    return Step(cache.length, torch.randn(1, 1, CONFIG.hidden_size))


async def _scheduler(span, compute, **options):
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32, **options)
    return scheduler, asyncio.create_task(scheduler.run())


async def test_a_lone_sessions_steps_after_its_first_run_on_the_event_loops_thread(span, serial_compute,
                                                                                   pass_threads, monkeypatch):
    monkeypatch.setattr(scheduler_module, "RUN_NOW_MAX_PASS_S", float("inf"))  # the pass's time cannot decide
    scheduler, runner = await _scheduler(span, serial_compute)
    try:
        cache = span.new_cache(0, 2, 1, 16, torch.float32)
        for _ in range(4):
            await scheduler.step("alone", cache, _step(cache))
        loop_thread = threading.get_ident()
        assert pass_threads[0] != loop_thread  # the first: no pass of this session before it
        assert pass_threads[1:] == [loop_thread] * 3
        assert scheduler.batches_run == 4 and cache.length == 4
    finally:
        runner.cancel()


async def test_a_step_run_at_once_equals_the_same_step_on_the_compute_thread(span, serial_compute, monkeypatch):
    monkeypatch.setattr(scheduler_module, "RUN_NOW_MAX_PASS_S", float("inf"))
    scheduler, runner = await _scheduler(span, serial_compute)
    try:
        now, later = (span.new_cache(0, 2, 1, 16, torch.float32) for _ in range(2))
        steps = [_step(now) for _ in range(3)]
        outputs_now = [await scheduler.step("now", now, step) for step in steps]
        monkeypatch.setattr(scheduler_module, "RUN_NOW_MAX_PASS_S", -1.0)  # every pass on the compute thread
        outputs_later = [await scheduler.step("later", later, step) for step in steps]
        for output_now, output_later in zip(outputs_now, outputs_later):
            assert torch.equal(output_now, output_later)
    finally:
        runner.cancel()


@pytest.mark.parametrize("case", ["shared previous pass", "previous pass too long", "batch wait", "not serial"])
async def test_other_steps_go_through_the_compute_thread(span, pass_threads, monkeypatch, case):
    compute = ComputeWorker(max_threads=1)
    if case != "not serial":
        compute.make_caller_serial()
    monkeypatch.setattr(scheduler_module, "RUN_NOW_MAX_PASS_S", -1.0 if case == "previous pass too long"
                        else float("inf"))
    scheduler, runner = await _scheduler(span, compute, batch_wait_s=1e-3 if case == "batch wait" else 0.0)
    try:
        caches = [span.new_cache(0, 2, 1, 16, torch.float32) for _ in range(2)]
        if case == "shared previous pass":  # both sessions' first steps share a pass; then one steps alone
            await asyncio.gather(*(scheduler.step(f"s{n}", cache, _step(cache)) for n, cache in enumerate(caches)))
        else:
            await scheduler.step("s0", caches[0], _step(caches[0]))
        await scheduler.step("s0", caches[0], _step(caches[0]))
        assert threading.get_ident() not in pass_threads
    finally:
        runner.cancel()
        compute.shutdown()


async def test_a_step_waits_for_the_compute_thread_while_another_sessions_pass_runs(span, serial_compute,
                                                                                    monkeypatch):
    monkeypatch.setattr(scheduler_module, "RUN_NOW_MAX_PASS_S", float("inf"))
    scheduler, runner = await _scheduler(span, serial_compute, max_batch_sessions=1)
    try:
        alone, other = (span.new_cache(0, 2, 1, 16, torch.float32) for _ in range(2))
        await scheduler.step("alone", alone, _step(alone))
        running = threading.Event()
        release = threading.Event()
        original = span.forward_segments

        def held(*args, **kwargs):  # the other session's pass holds the compute thread until released
            running.set()
            release.wait(60)
            return original(*args, **kwargs)

        monkeypatch.setattr(span, "forward_segments", held)
        other_step = asyncio.ensure_future(scheduler.step("other", other, _step(other)))
        await asyncio.get_running_loop().run_in_executor(None, running.wait, 60)
        monkeypatch.setattr(span, "forward_segments", original)
        lone_step = asyncio.ensure_future(scheduler.step("alone", alone, _step(alone)))
        await asyncio.sleep(0)
        assert not lone_step.done()  # queued behind the running pass, not run on the loop meanwhile
        release.set()
        await asyncio.gather(other_step, lone_step)
        assert alone.length == 2 and other.length == 1
    finally:
        release.set()
        runner.cancel()
