"""Steps a hostile (or broken) peer may send that must not corrupt other sessions, make one frame
cost many passes, or pile up work on the server: checked on the server's parts, without processes
or network (tests/swarm/test_bad_requests.py speaks raw frames to a real server)."""

import asyncio
import struct
from types import SimpleNamespace

import pytest
import torch

from bloompeer.blocks import SessionCache
from bloompeer.p2p import (
    ErrorCode, IncomingStream, OpenSession, ProtocolError, PushStep, PushTarget, RemoteError, Step, pack,
)
from bloompeer.peer.server import handlers
from bloompeer.peer.server.config import ServerConfig
from bloompeer.peer.server.current_node import CurrentNode
from bloompeer.peer.server.metrics import ServerMetrics
from bloompeer.peer.server.push import PushSender
from bloompeer.peer.server.scheduler import Scheduler
from bloompeer.peer.server.span_service import SpanService

from .conftest import SPAN_CONFIG as CONFIG

HIDDEN = CONFIG.hidden_size


async def _queued(scheduler: Scheduler, depth: int) -> None:
    while scheduler.queue_depth != depth:
        await asyncio.sleep(0.002)


def _filled_cache(span, batch: int, cached: int, seed: int) -> SessionCache:
    torch.manual_seed(seed)
    cache = span.new_cache(span.start, span.end, batch, 64, torch.float32)
    with torch.inference_mode():
        span(torch.randn(batch, cached, HIDDEN), cache.begin_step(0, None, cached), cache)
    return cache


async def _run_queued(scheduler: Scheduler, *requests):
    """Queue every request before the scheduler first looks (so that it may batch them), then run them."""
    results = asyncio.gather(*requests, return_exceptions=True)
    await _queued(scheduler, len(requests))
    runner = asyncio.create_task(scheduler.run())
    try:
        return await results
    finally:
        runner.cancel()


async def test_two_steps_of_one_session_never_share_a_pass(span, compute):
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32)
    cache = _filled_cache(span, 1, 3, seed=0)
    first, second = torch.randn(1, 1, HIDDEN), torch.randn(1, 1, HIDDEN)
    outputs = await _run_queued(scheduler, scheduler.step("s", cache, Step(3, first)),
                                scheduler.step("s", cache, Step(4, second)))
    assert scheduler.batches_run == 2  # not one pass that fails and falls back to one by one
    reference = _filled_cache(span, 1, 3, seed=0)
    with torch.inference_mode():
        expected = [span(hidden, reference.begin_step(position, None, 1), reference)
                    for position, hidden in ((3, first), (4, second))]
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


class _BrokenCache(SessionCache):
    def update(self, layer_idx, *new):
        raise RuntimeError("boom")


async def test_a_failed_batch_reorders_the_beams_of_the_others_once(span, compute):
    """A batch that fails runs its requests again one by one; a beam session's reordering of its
    cache must not be applied a second time then."""
    scheduler = Scheduler(span, compute, max_batch_tokens=64, device="cpu", dtype=torch.float32)
    beams = _filled_cache(span, 3, 2, seed=1)
    broken = _BrokenCache(span.cache_layouts(0, 2), 0, 2, 1, 8, torch.float32)
    hypo_ids, hidden = torch.tensor([1, 2, 0]), torch.randn(3, 1, HIDDEN)
    output, error = await _run_queued(scheduler, scheduler.step("beams", beams, Step(2, hidden, hypo_ids=hypo_ids)),
                                      scheduler.step("broken", broken, Step(0, torch.randn(1, 1, HIDDEN))))
    assert scheduler.batches_run == 1 and isinstance(error, RuntimeError)
    reference = _filled_cache(span, 3, 2, seed=1)
    reference.reorder(hypo_ids)
    with torch.inference_mode():
        expected = span(hidden, reference.begin_step(2, None, 1), reference)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(beams.keys[:, :, :, :3], reference.keys[:, :, :, :3], rtol=0, atol=1e-5)


@pytest.fixture
async def service(span, compute):
    cache_bytes = 256 * span.cache_nbytes(span.start, span.end, 1, 1, torch.float32)  # 256 tokens
    service = SpanService(span, "m", ServerConfig(model="m", start=0, end=2), cache_bytes, compute, ServerMetrics(),
                          accepting=lambda: True)
    yield service
    await service.retire()


async def _open(service, batch: int = 1):
    async def deliver(message):
        pass

    return await service.backend.open_session("peer", OpenSession("m", 0, 2, batch, 16), lambda: None, deliver)


async def test_a_sessions_steps_run_one_at_a_time_each_checked_against_the_cache_it_runs_on(service):
    """Sent at once, a rewind to position 1 and a step at position 3 (valid when both arrive, with 3
    tokens cached): the rewind runs first, and leaves 2 tokens, so the second is refused rather
    than run with a hole in the cache."""
    session = await _open(service)
    await service.backend.step(session, Step(0, torch.randn(1, 3, HIDDEN)))
    rewind, ahead = await asyncio.gather(service.backend.step(session, Step(1, torch.randn(1, 1, HIDDEN))),
                                         service.backend.step(session, Step(3, torch.randn(1, 1, HIDDEN))),
                                         return_exceptions=True)
    assert isinstance(rewind, torch.Tensor) and session.cache.length == 2
    assert isinstance(ahead, ProtocolError) and "past the 2 cached tokens" in str(ahead)


async def test_push_hops_that_name_a_session_twice_are_refused(service):
    session, other = await _open(service), await _open(service)
    hidden = torch.randn(1, 1, HIDDEN)
    for hops in ([PushTarget("self", session.id)],  # a loop through this very session
                 [PushTarget("next", other.id), PushTarget("after", other.id)]):
        with pytest.raises(ProtocolError, match="every hop must be another session"):
            await service.backend.step(session, Step(0, hidden, push=tuple(hops)))
    assert session.cache.length == 0  # refused before anything ran


async def test_an_empty_batch_is_refused_not_computed(service):
    session = await _open(service)
    with pytest.raises(ProtocolError, match=r"batch >= 1") as info:
        await service.backend.step(session, Step(0, torch.zeros(0, 1, HIDDEN)))
    assert info.value.code is ErrorCode.BAD_REQUEST


class _WaitingBackend:
    """A backend whose steps wait until released, counting how many wait at once."""

    def __init__(self, session):
        self.session, self.metrics = session, ServerMetrics()
        self.server_config = ServerConfig(model="m", start=0, end=2)
        self.registry = self
        self.waiting, self.most_waiting, self.release = 0, 0, asyncio.Event()

    def find(self, token):
        return self.session

    async def step(self, session, step, clock=None):
        self.waiting += 1
        self.most_waiting = max(self.most_waiting, self.waiting)
        await self.release.wait()
        self.waiting -= 1
        return step.hidden


class _Session:
    peer_id_str, id = "client", "token"

    async def deliver(self, message):
        pass


class _Writer:
    def close(self):
        pass


async def test_a_push_stream_computes_a_bounded_number_of_steps_at_once(monkeypatch):
    monkeypatch.setattr(handlers, "MAX_PUSHED_IN_FLIGHT", 4)
    backend = _WaitingBackend(_Session())
    reader = asyncio.StreamReader()
    for position in range(10):
        payload = pack(PushStep("token", Step(position, torch.randn(1, 1, HIDDEN))).to_wire())
        reader.feed_data(struct.pack(">Q", len(payload)) + payload)
    reader.feed_eof()
    stream = asyncio.create_task(handlers.handle_push_stream(lambda: backend, None,
                                                             IncomingStream("sender", reader, _Writer())))
    while backend.waiting < 4:
        await asyncio.sleep(0.002)
    for _ in range(20):  # the stream is not read on while four steps wait
        await asyncio.sleep(0)
    assert backend.waiting == 4 and not stream.done()
    backend.release.set()
    await asyncio.wait_for(stream, 10)
    assert backend.most_waiting == 4 and backend.waiting == 0


class _StuckWriter:
    """A stream whose peer stopped reading: writes are taken, drain never returns."""

    def __init__(self):
        self.closed = False

    def write(self, data):
        pass

    async def drain(self):
        await asyncio.Event().wait()

    def close(self):
        self.closed = True


async def test_an_answer_its_client_does_not_take_ends_the_stream(monkeypatch):
    monkeypatch.setattr(handlers, "DELIVER_TIMEOUT_S", 0.05)
    writer = _StuckWriter()
    stream = handlers._InferenceStream(None, None, IncomingStream("client", None, writer))
    await asyncio.wait_for(stream.send(handlers.ErrorFrame(ErrorCode.BUSY, "x")), 10)
    assert writer.closed  # the stream (and with it the session) ends; the step is not left waiting


async def test_the_push_sender_forgets_a_hop_it_could_not_reach(monkeypatch):
    sender = PushSender(CurrentNode(SimpleNamespace(p2p=None, peer_id_str="me")))

    async def unreachable(peer_id_str):
        raise RemoteError(ErrorCode.TIMEOUT, "cannot reach it", peer_id_str)

    monkeypatch.setattr(sender, "_stream", unreachable)
    step = PushStep("token", Step(0, torch.zeros(1, 1, HIDDEN)))
    await asyncio.gather(*(sender.push(PushTarget(f"peer-{index % 3}", "token"), step) for index in range(9)))
    assert not sender._locks and not sender._pushing
