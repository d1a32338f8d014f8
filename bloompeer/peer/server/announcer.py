"""A server's record on the DHT: what it says, when it is stored again, and the round trips to the
next servers that it carries.

The server announces each change of its state (joining, online, draining, offline). Between
changes the record is stored again every period, with an expiration a few periods ahead, so a
server that dies without a word (SIGKILL) disappears on its own. The round trips to the servers it
could push to (push_rtts.py) are kept fresh too, and a change of that set is announced at once:
clients route pushed chains by them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..._version import __version__
from ...blocks import Checkpoint
from ...p2p import RequestLimits, ServerRecord, ServerState, announceable, get_dht_time
from .config import ServerConfig
from .current_node import CurrentNode
from .metrics import ServerMetrics
from .push_rtts import PushRtts

__all__ = ["Announcer", "Standing"]

logger = logging.getLogger(__name__)

RECORD_LIFETIME_PERIODS = 3
REANNOUNCE_AFTER_JOINING_S = 5.0  # the one early refresh of the record (Announcer.run)
NEXT_HOPS_CHECK_S = 5.0  # how often the DHT is read for new servers to push to (pinged, then announced)


@dataclass(frozen=True)
class Standing:
    """What a server's record says that changes as it runs: read from the server at each announcement."""

    state: ServerState
    start: int | None  # the span served, half-open (None: not chosen yet)
    end: int | None
    throughput: float  # decode tokens per second through one block (0: not measured yet)
    cache_tokens_left: int


class Announcer:
    """Keeps one server's record on the DHT: `standing()` says where the server stands now, the
    rest of the record is the server's settings, its model and its node (read at each use: a
    rejoin behind NAT changes the relays it is reached through).

    `sleep` is how the periodic loops wait; a test passes one that steps them without waiting.
    """

    def __init__(self, node: CurrentNode, config: ServerConfig, checkpoint: Checkpoint,
                 standing: Callable[[], Standing], metrics: ServerMetrics,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.node, self.config, self.metrics = node, config, metrics
        self.model_uid, self.family = checkpoint.model_uid, checkpoint.family.name
        self.num_model_blocks = checkpoint.config().num_hidden_layers
        self.fingerprint = checkpoint.fingerprint()
        self.push_rtts = PushRtts(node)  # round trips to our possible next hops, carried in the record
        self._standing, self._sleep = standing, sleep

    def record(self) -> ServerRecord:
        """The record as the server stands now."""
        standing, config, relays = self._standing(), self.config, self.node.relays
        return ServerRecord(
            peer_id=self.node.peer_id_str, state=standing.state, start=standing.start, end=standing.end,
            throughput=standing.throughput, cache_tokens_left=standing.cache_tokens_left,
            weights=config.weights, version=__version__, weights_fingerprint=self.fingerprint,
            relayed=relays is not None, relay_maddrs=announceable(self.node.relay_maddrs),
            via_relays=relays.announced() if relays is not None else (),
            limits=RequestLimits(config.max_batch, config.max_length, config.max_step_tokens),
            push_rtts_s=self.push_rtts.announced(), family=self.family,
        )

    async def announce(self, record: ServerRecord | None = None, blocks: list[int] | None = None) -> bool:
        """Store `record` (default: the present one) under `blocks` (default: the record's own)."""
        record = record or self.record()
        blocks = list(range(record.start, record.end)) if blocks is None else blocks
        if not blocks:
            return True
        expiration = get_dht_time() + RECORD_LIFETIME_PERIODS * self.config.announce_period_s
        self.metrics.count_dht("announce", len(blocks))
        ok = await self.node.directory.announce(self.model_uid, blocks, record, expiration)
        if not ok:
            standing = self._standing()
            again = " (will retry)" if (record.start, record.end) == (standing.start, standing.end) else ""
            logger.warning("Could not announce %s blocks %d:%d as %s on the DHT%s",
                           self.model_uid, blocks[0], blocks[-1] + 1, record.state.value, again)
        return ok

    async def run(self) -> None:
        """Store the record again every period, and once soon after going online (run as a task from
        then): the first store went to the peers that a young routing table knew, and servers that
        joined at the same moment may be nearer the keys by now, where lookups go; without it a
        lookup could miss the server for a period."""
        await self._sleep(min(REANNOUNCE_AFTER_JOINING_S, self.config.announce_period_s))
        while True:
            await self.announce()
            await self._sleep(self.config.announce_period_s)

    async def measure_next_hops(self) -> None:
        """Keep round trips to the servers we could push to fresh; announce at once when the set
        changes (run as a task). A look that fails is logged, and the next one tried."""
        while True:
            try:
                servers = await self.node.directory.find_servers(self.model_uid, self.num_model_blocks)
                self.metrics.count_dht("lookup", self.num_model_blocks)
                standing = self._standing()
                if await self.push_rtts.refresh(servers, standing.start, standing.end) and \
                        self._standing().state is ServerState.ONLINE:
                    await self.announce()
            except Exception:
                logger.warning("Could not measure the round trips to the next servers", exc_info=True)
            await self._sleep(NEXT_HOPS_CHECK_S)
