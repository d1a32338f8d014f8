"""Where a step's output goes: on to the next server of its client's chain (a push), and back to
the session's client.

With push, a server sends its output for a step straight to the next server of the client's
chain, so one step costs one pass along the chain instead of a round trip per server. `run_step`
computes a step (from the client, or pushed to us), passes its output on and answers the client;
`PushSender` keeps the streams to next hops open, shared by all sessions going that way. A push
that cannot be delivered is dropped with a warning: the client, missing that hop's answer,
recovers as from any failed server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from ...p2p import PUSH_PROTOCOL, ErrorCode, PeerStream, PushStep, PushTarget, RemoteError, Step, StepOutput
from .backend import SpanBackend, error_frame
from .current_node import CurrentNode
from .sessions import Session
from .step_clock import StepClock

__all__ = ["PushSender", "pushed_session", "run_step"]

logger = logging.getLogger(__name__)


class PushSender:
    """Sends steps on to next hops, over one kept stream per hop, opened through the node of now (a
    rejoin ends the old daemon's streams: `close` forgets them)."""

    def __init__(self, node: CurrentNode, timeout_s: float = 10.0):
        self.node, self.timeout_s = node, timeout_s
        self._streams: dict[str, PeerStream] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._pushing: Counter[str] = Counter()  # pushes under way (or waiting) per next hop

    @property
    def own_peer_id(self) -> str:  # a hop here is no push: _pass_on
        return self.node.peer_id_str

    async def push(self, target: PushTarget, step: PushStep) -> None:
        peer = target.peer_id_str
        lock = self._locks.setdefault(peer, asyncio.Lock())
        self._pushing[peer] += 1
        try:
            async with lock:  # one frame at a time per stream; a fresh stream if the kept one broke
                await self._send(peer, step)
        finally:
            self._pushing[peer] -= 1
            if not self._pushing[peer]:  # forget a hop nobody pushes to and no stream is kept for: a
                del self._pushing[peer]  # client may name any peer id as its next hop
                if peer not in self._streams:
                    del self._locks[peer]

    async def _send(self, peer: str, step: PushStep) -> None:
        for attempt in range(2):
            try:
                stream = await self._stream(peer)
                await stream.send(step, self.timeout_s)
                return
            except RemoteError as exc:
                self._drop(peer)
                if attempt:
                    logger.warning("Could not push a step to %s: %r", peer, exc)

    async def _stream(self, peer_id_str: str) -> PeerStream:
        if peer_id_str not in self._streams:
            self._streams[peer_id_str] = await PeerStream.open(self.node.p2p, peer_id_str, PUSH_PROTOCOL,
                                                               self.timeout_s, "push")
        return self._streams[peer_id_str]

    def _drop(self, peer_id_str: str) -> None:
        stream = self._streams.pop(peer_id_str, None)
        if stream is not None:
            stream.writer.close()

    def close(self) -> None:
        for peer_id_str in list(self._streams):
            self._drop(peer_id_str)


async def run_step(backend: SpanBackend, pusher: PushSender, session: Session, step: Step, received: float,
                   pushed: bool = False) -> None:
    """Compute a step of `session` (whose frame was all in at `received`, a time.perf_counter()), push
    the output on to the next hop (if the client asked), and answer the session's client. Used for
    steps from the client and for steps pushed to us."""
    kind, clock = "push" if pushed else "step", StepClock(received)
    try:
        output = await backend.step(session, step, clock)
        clock.output_is_ready()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        error = error_frame(exc, session.peer_id_str)
        backend.metrics.count_request(kind, error.code)
        await session.deliver(error)
        return
    backend.metrics.step_latency.observe(clock.output_ready - received)
    backend.metrics.count_request(kind)
    deliveries = []
    if step.push:  # first: the rest of the chain waits for it, while the client only keeps its copy
        hop, rest = step.push[0], step.push[1:]
        pushed = PushStep(hop.session_id, Step(step.position, output, step.padding_mask, step.hypo_ids, step.step_id,
                                               rest))
        deliveries.append(_pass_on(backend, pusher, hop, pushed))
    deliveries.append(session.deliver(StepOutput(output, step.step_id)))
    await asyncio.gather(clock.time_sending(deliveries[0]), *deliveries[1:])
    backend.metrics.observe_step_phases(clock.phases())


async def _pass_on(backend: SpanBackend, pusher: PushSender, hop: PushTarget, pushed: PushStep) -> None:
    """Push a step to the next hop. A hop on this very server (a client's route can hold two
    neighbouring spans here: after the server between them failed, the blocks it had are routed to
    us again) is run here: libp2p refuses a dial to oneself, and the client would wait for an
    answer that never comes, ban us, route the blocks to us again, and so on until it gives up."""
    if hop.peer_id_str != pusher.own_peer_id:
        await pusher.push(hop, pushed)
        return
    session = pushed_session(backend, pushed, hop.peer_id_str)
    if session is not None:
        await run_step(backend, pusher, session, pushed.step, time.perf_counter(), pushed=True)


def pushed_session(backend: SpanBackend, pushed: PushStep, sender: str) -> Session | None:
    """The session a pushed step is for, or None (counted, and the step dropped: the client
    recovers as from a failed server) if it is not open here."""
    session = backend.registry.find(pushed.session_id)
    if session is None:
        logger.debug("%s pushed a step to an unknown session", sender)
        backend.metrics.count_request("push", ErrorCode.NOT_SERVING)
    return session
