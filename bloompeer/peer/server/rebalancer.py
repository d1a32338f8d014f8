"""A `--num-blocks` server's watch over the swarm: every period (jittered, so that servers started
together do not look at the same moment), it reads the model's records, asks the servers they name
whether they are there, and moves where block_choice.py says the swarm needs it.

Records alone cannot tell: a server killed without a word keeps its records `online` until they
expire (three announce periods), so each server named in a record is asked for its info frame
(the same cheap request as a ping), and counts only if it answers with the span its record gives.

Several servers may see one gap at once. Each that wants to move waits a random delay, then looks
again (records and answers), and moves only if the move is still good: the first to commit
announces its new span `joining` at once, so the others' second look finds the gap taken.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
from collections.abc import Awaitable, Callable

from ...p2p import INFO_PROTOCOL, P2P, RemoteError, ServerInfo, ServerRecord, request_once
from .block_choice import Move, ServedSpan, choose_blocks, live_spans, plan_move, strengths
from .current_node import CurrentNode
from .metrics import ServerMetrics

__all__ = ["Rebalancer", "probe"]

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # generous: a live server on a busy machine must not be taken for dead
MAX_PROBES = 64  # servers asked per look; beyond that, those of the weakest blocks (the rest count on their records)
PROBE_CONCURRENCY = 16
JITTER = 0.5  # each period lasts between (1 - JITTER) and (1 + JITTER) times the configured one


async def probe(p2p: P2P, peer_id_str: str, timeout_s: float = PROBE_TIMEOUT_S) -> ServerInfo | None:
    """The server's info frame (what it serves, in what state), or None if it does not answer."""
    try:
        return await request_once(p2p, peer_id_str, INFO_PROTOCOL, None, ServerInfo, timeout_s, "liveness")
    except RemoteError as exc:
        logger.debug("%s did not answer: %s", peer_id_str, exc)
        return None


class Rebalancer:
    """Looks at the swarm of one model for one server: `node` is the server's, `me()` where it is
    now, and `move(plan)` moves it (and announces the new span at once)."""

    def __init__(self, node: CurrentNode, model_uid: str, num_model_blocks: int, metrics: ServerMetrics,
                 period_s: float, delay_s: float):
        self.node, self.model_uid, self.num_model_blocks = node, model_uid, num_model_blocks
        self.metrics, self.period_s, self.delay_s = metrics, period_s, delay_s

    async def survey(self, read_again: bool = False) -> list[ServedSpan]:
        """Other servers' live spans: the records, checked by asking their servers. read_again: read
        the records once more after the answers came, so that a decision taken on them is as fresh
        as it can be (the answers take up to PROBE_TIMEOUT_S)."""
        servers = await self._records()
        peers = self._to_probe(servers)
        semaphore = asyncio.Semaphore(PROBE_CONCURRENCY)

        async def ask(peer: str) -> ServerInfo | None:
            async with semaphore:
                return await probe(self.node.p2p, peer)

        answers = dict(zip(peers, await asyncio.gather(*(ask(peer) for peer in peers))))
        for answer in answers.values():
            self.metrics.count_probe(answer is not None)
        silent = sorted(peer for peer, answer in answers.items() if answer is None)
        if silent:
            logger.debug("No answer from %d server(s) with live records: %s", len(silent), ", ".join(silent))
        if read_again:
            servers = await self._records()
        return live_spans(servers, answers, self.node.peer_id_str, self.model_uid)

    async def _records(self) -> dict[int, list[ServerRecord]]:
        servers = await self.node.directory.find_servers(self.model_uid, self.num_model_blocks)
        self.metrics.count_dht("lookup", self.num_model_blocks)
        return servers

    def _to_probe(self, servers: dict[int, list[ServerRecord]]) -> list[str]:
        """Peers with live records, those of the weakest blocks (by their records) first."""
        spans = live_spans(servers, {}, self.node.peer_id_str, self.model_uid)
        strength = strengths(spans, self.num_model_blocks)
        weakest: dict[str, float] = {}
        for span in spans:
            held = strength[span.start:span.end] or [0.0]
            weakest[span.peer_id] = min(weakest.get(span.peer_id, float("inf")), min(held))
        return sorted(weakest, key=lambda peer: (weakest[peer], peer))[:MAX_PROBES]

    async def choose(self, count: int, throughput: float | None) -> tuple[int, int]:
        """Where a new server of `count` blocks should start (throughput None: not measured yet, taken
        as the swarm's median)."""
        others = await self.survey()
        assumed = throughput or statistics.median([span.throughput for span in others] or [1.0])
        return choose_blocks(others, self.num_model_blocks, count, assumed)

    async def run(self, me: Callable[[], ServedSpan], move: Callable[[Move], Awaitable[None]]) -> None:
        """Look every period and move when the swarm needs it (run as a task). A look that fails is
        logged and the next one tried; a move that fails ends the task with its error."""
        while True:
            await asyncio.sleep(self.period_s * random.uniform(1 - JITTER, 1 + JITTER))
            try:
                plan = await self.check(me)
            except Exception:
                logger.warning("Could not look at the swarm for where blocks are needed", exc_info=True)
                continue
            if plan is not None:
                await move(plan)

    async def check(self, me: Callable[[], ServedSpan]) -> Move | None:
        """A move worth making now, seen twice, a random delay apart; None to stay."""
        self.metrics.count_rebalance_check()
        plan = plan_move(await self.survey(), me(), self.num_model_blocks)
        if plan is None:
            return None
        delay_s = random.uniform(0, self.delay_s)
        logger.info("Blocks %d:%d would serve the swarm better (%s); looking again in %.1f s", plan.start, plan.end,
                    plan.reason, delay_s)
        await asyncio.sleep(delay_s)
        again = plan_move(await self.survey(read_again=True), me(), self.num_model_blocks)
        if again is None:
            logger.info("Staying: the swarm no longer needs the move (another server may have taken it)")
        return again

