"""Small stand-ins for the swarm at the unit level: a swarm view over fixed records (no DHT, no
pings), and inference "servers" whose answer depends on everything their cache holds, so that a
replay that forgets or repeats a step, or a rewind that is not honoured, changes the output."""

from __future__ import annotations

import time

import torch

from bloompeer.p2p import (
    ErrorCode, FoundRecord, PeerUnavailableError, RequestLimits, ServerRecord, ServerState, Step,
)
from bloompeer.peer.client.health import BanList
from bloompeer.peer.client.routing import ServerFilter, SpanRoute
from bloompeer.peer.client.swarm import SwarmView
from bloompeer.weight_format import WeightFormat

NUM_BLOCKS = 4


def record(peer: str, start: int, end: int, max_length: int = 1024) -> ServerRecord:
    return ServerRecord(peer, ServerState.ONLINE, start, end, 100.0, 1 << 20, WeightFormat(), "0", "f", False,
                        RequestLimits(max_batch=8, max_length=max_length, max_step_tokens=4096))


class FixedDirectory:
    """The DHT's answer, always the same records."""

    def __init__(self, records: list[ServerRecord]):
        self.records = records

    async def find_records(self, model_uid: str, num_model_blocks: int) -> dict[int, list[FoundRecord]]:
        forever = float("inf")
        return {i: [FoundRecord(r, forever) for r in self.records if r.start <= i < r.end]
                for i in range(num_model_blocks)}


def swarm_of(*records: ServerRecord, rtts_s: dict[str, float] | None = None) -> SwarmView:
    """A view that knows these servers and their round trips already, so it never pings."""
    view = SwarmView(None, FixedDirectory(list(records)), "tiny", NUM_BLOCKS, ServerFilter(None),
                      refresh_period_s=3600.0)
    view.announced = view.servers = {i: [r for r in records if r.start <= i < r.end] for i in range(NUM_BLOCKS)}
    view.rtts_s = {r.peer_id: (rtts_s or {}).get(r.peer_id, 0.001) for r in records}
    view._pinged_at = dict.fromkeys(view.rtts_s, time.monotonic())
    view._updated_at = time.monotonic()
    view.bans = BanList()
    return view


class FakeServers:
    """Inference sessions of pretend servers. A span's output for a token is its input plus the
    mean of every input its cache holds up to that token, plus the span's first block index: a
    deterministic function of the whole cached prefix, as attention is."""

    def __init__(self):
        self.received: dict[str, list[Step]] = {}  # peer -> every step it was sent
        self.fail_next: dict[str, int] = {}  # peer -> fail on its n-th next step (1: the next one)
        self.opened: list[SpanRoute] = []
        self.closed: list[SpanRoute] = []

    def session_class(self):
        servers = self

        class FakeSpanSession:
            def __init__(self, route: SpanRoute):
                self.route, self.session_id, self.cache = route, f"s-{route.peer_id_str}", torch.zeros(1, 0, 1)
                self._answer: torch.Tensor | None = None

            @classmethod
            async def open(cls, p2p, route, model_uid, batch, max_length, timeout_s, alloc_timeout_s):
                servers.opened.append(route)
                return cls(route)

            async def step(self, step: Step) -> torch.Tensor:
                await self.send(step)
                return await self.receive(step.step_id, step.hidden)

            async def send(self, step: Step) -> None:
                peer = self.route.peer_id_str
                servers.received.setdefault(peer, []).append(step)
                if peer in servers.fail_next:
                    servers.fail_next[peer] -= 1
                    if servers.fail_next[peer] == 0:
                        del servers.fail_next[peer]
                        raise PeerUnavailableError(ErrorCode.NOT_SERVING, "stream lost", peer)
                self.cache = torch.cat([self.cache[:, :step.position], step.hidden], dim=1)  # overwrite from position
                self._answer = span_function(self.cache, self.route.start)[:, step.position:]

            async def receive(self, step_id: int, like: torch.Tensor) -> torch.Tensor:
                return self._answer

            async def close(self) -> None:
                servers.closed.append(self.route)

        return FakeSpanSession


def span_function(cached: torch.Tensor, first_block: int) -> torch.Tensor:
    """[1, tokens, 1] everything the span holds -> its output for every one of those tokens."""
    prefix_means = cached.cumsum(dim=1) / torch.arange(1, cached.shape[1] + 1).view(1, -1, 1)
    return cached + prefix_means + first_block


def chain_function(tokens: torch.Tensor, routes: list[tuple[int, int]]) -> torch.Tensor:
    """What a fault-free chain of spans starting at these blocks outputs for the whole sequence."""
    for start, _ in routes:
        tokens = span_function(tokens, start)
    return tokens
