"""A served span retired for a move (span_service.py), without processes or network: its sessions end,
queued work and new requests are refused with not_serving, and its weights are freed at once."""

import asyncio
import threading

import pytest
import torch

from bloompeer.blocks.bloom import BloomSpan
from bloompeer.p2p import ErrorCode, OpenSession, ProtocolError, Step
from bloompeer.peer.server.config import ServerConfig
from bloompeer.peer.server.metrics import ServerMetrics
from bloompeer.peer.server.span_service import SpanService

from .conftest import SPAN_CONFIG


async def test_a_retired_span_ends_its_sessions_refuses_work_and_frees_its_weights(compute):
    torch.manual_seed(0)
    span = BloomSpan(SPAN_CONFIG, 0, 2).eval().requires_grad_(False)
    config = ServerConfig(model="m", start=0, end=2)
    service = SpanService(span, "m", config, 1 << 20, compute, ServerMetrics(), accepting=lambda: True)
    ended = []

    async def deliver(message):
        pass

    session = await service.backend.open_session("peer", OpenSession("m", 0, 2, 1, 8), lambda: ended.append(1),
                                                 deliver)
    hidden = torch.randn(1, 3, SPAN_CONFIG.hidden_size)
    await service.backend.step(session, Step(0, hidden))
    weights = [parameter for parameter in span.parameters()]
    assert all(weight.device.type == "cpu" for weight in weights)

    await service.retire()
    assert ended == [1] and not service.registry.sessions and service.budget.used_bytes == 0
    assert all(parameter.device.type == "meta" for parameter in span.parameters())
    for request in (service.backend.step(session, Step(3, hidden[:, :1])),
                    service.backend.open_session("peer", OpenSession("m", 0, 2, 1, 8), lambda: None, deliver)):
        with pytest.raises(ProtocolError) as info:
            await request
        assert info.value.code is ErrorCode.NOT_SERVING
    await service.retire()  # idempotent


async def test_stopping_the_scheduler_refuses_what_waits_and_lets_the_running_pass_answer(compute):
    torch.manual_seed(0)
    span = BloomSpan(SPAN_CONFIG, 0, 2).eval().requires_grad_(False)
    service = SpanService(span, "m", ServerConfig(model="m", start=0, end=2), 1 << 20, compute, ServerMetrics(),
                          accepting=lambda: True)
    busy = threading.Event()
    blocking = asyncio.ensure_future(compute.run(busy.wait))  # holds the compute thread: a pass waits on it
    hidden = torch.randn(1, 4, SPAN_CONFIG.hidden_size)
    forwards = [asyncio.ensure_future(service.scheduler.forward(hidden, None, 0, 2)) for _ in range(3)]
    while service.scheduler.queue_depth != 2:  # the first one's pass has started, the others wait
        await asyncio.sleep(0.001)
    stopping = asyncio.ensure_future(service.scheduler.stop())
    for _ in range(20):  # every task that can run does, a few times over
        await asyncio.sleep(0)
    assert not stopping.done()  # the running pass answers first
    busy.set()
    await asyncio.wait_for(asyncio.gather(stopping, blocking), 60)
    results = await asyncio.gather(*forwards, return_exceptions=True)
    assert isinstance(results[0], torch.Tensor)
    assert all(isinstance(result, ProtocolError) and result.code is ErrorCode.NOT_SERVING for result in results[1:])
    await service.stop_tasks()
