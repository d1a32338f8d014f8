"""A running server: its blocks, its place in the network, its handlers and its DHT announcements.

Lifecycle: joining (network up, weights loading) -> online (serving) -> draining (SIGTERM: no new
sessions; open ones are told to move) -> offline (announced, then shut down). The state is
announced on the DHT at each change and re-announced every period, with an expiration a few
periods ahead, so a server that dies without a word (SIGKILL) disappears on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence

import torch

from ..._version import __version__
from ...blocks import BlockSpan, Checkpoint, open_checkpoint
from ...p2p import (
    BACKWARD_PROTOCOL, FORWARD_PROTOCOL, INFERENCE_PROTOCOL, INFO_PROTOCOL, PUSH_PROTOCOL, IncomingStream, PeerNode,
    RelaySlots,
    ServerInfo, RequestLimits, ServerRecord, ServerState, announceable, get_dht_time, relays_in_records,
)
from .backend import SpanBackend
from .block_choice import Move, ServedSpan
from .compute import ComputeWorker, check_device
from .config import ServerConfig
from .current_node import CurrentNode
from .handlers import handle_forward_stream, handle_inference_stream, handle_info_stream, handle_push_stream
from .memory_plan import MemoryPlan, plan_memory
from .metrics import LiveState, MetricsEndpoint, ServerMetrics
from .push import PushSender
from .push_rtts import PushRtts
from .quantization import WeightStorage
from .reachability import Joined, behind_relays, join_network
from .rebalancer import Rebalancer
from .relay_keeper import RelayKeeper
from .span_service import SpanService
from .startup_clock import StartupClock
from .throughput import MEASURE_STEPS, QUICK_STEPS, cached_throughput, measure_throughput

__all__ = ["Server"]

logger = logging.getLogger(__name__)

RECORD_LIFETIME_PERIODS = 3
REANNOUNCE_AFTER_JOINING_S = 5.0  # the one early refresh of the record (_announce_periodically)
NEXT_HOPS_CHECK_S = 5.0  # how often the DHT is read for new servers to push to (pinged, then announced)
STOP_STEP_S = 3.0  # the most each step of a shutdown waits (Server.shutdown)


class Server:
    """One volunteer's contribution: a contiguous span of blocks, served to whoever asks, for as long
    as the process runs (and, with --num-blocks, moved to other blocks when the swarm needs them).

    It owns everything with the server's lifetime (network peer, compute thread, the span served
    now, DHT announcer, rebalancer) so that shutdown can release them in one defined order: stop the
    background tasks, say goodbye on the DHT while the daemon still lives, then close the network
    and the compute thread. Handlers get the parts they need, never the Server, so the
    request path has no way to reach into the lifecycle.
    """

    def __init__(self, config: ServerConfig, checkpoint: Checkpoint, joined: Joined, compute: ComputeWorker,
                 memory_plan: MemoryPlan):
        self.config, self.checkpoint, self.compute = config, checkpoint, compute
        # the node now (a rejoin behind NAT replaces it): every part reads it there, none keeps it
        self.current = CurrentNode(joined.node, joined.relays, joined.reachable if joined.node.relaying else ())
        self.reachability = joined.line
        self.model_uid = checkpoint.model_uid
        self.fingerprint = checkpoint.fingerprint()
        self.start, self.end = config.start, config.end
        self.storage = WeightStorage(config.quant, config.quant_group_size)
        self.memory_plan = memory_plan  # made before anything started: how many blocks, in what memory
        self.throughput = config.throughput or 0.0
        self.state = ServerState.JOINING
        self.service: SpanService | None = None  # the span served now (a retired one during a move)
        self.rebalancer: Rebalancer | None = None  # with --num-blocks
        self.pusher = PushSender(self.current)
        self.push_rtts = PushRtts(self.current)
        self.metrics = ServerMetrics()
        self.metrics_endpoint: MetricsEndpoint | None = None  # with --metrics-port
        self.on_move: Callable[[str, Move], None] = lambda stage, plan: None  # "moving", then "online"
        self.on_relays: Callable[[str], None] = lambda line: None  # a relay left and others replaced it
        self.failed = asyncio.Event()  # a background task that cannot go on (a move that could not load)
        self._tasks: list[asyncio.Task] = []  # announcer, next hops, rebalancer, relay keeper
        self.startup = StartupClock()

    @classmethod
    async def create(cls, config: ServerConfig) -> Server:
        """Join the network, load the blocks, register the handlers and announce online."""
        check_device(config.device)
        checkpoint = open_checkpoint(config.model)
        num_blocks = checkpoint.config().num_hidden_layers
        if config.start is not None and not 0 <= config.start < config.end <= num_blocks:
            raise ValueError(f"--blocks {config.start}:{config.end} is not a range within {checkpoint.model_uid}'s "
                             f"{num_blocks} blocks (0:{num_blocks})")
        if config.start is None and not 0 <= config.num_blocks <= num_blocks:
            raise ValueError(f"--num-blocks {config.num_blocks} is not between 1 and {checkpoint.model_uid}'s "
                             f"{num_blocks} blocks")
        storage = WeightStorage(config.quant, config.quant_group_size)
        storage.check(checkpoint, config.device)
        wanted = config.end - config.start if config.start is not None else config.num_blocks or None
        plan = plan_memory(config, checkpoint, wanted, storage)  # before the network: a refusal costs nothing
        logger.info("Memory plan: %s", plan)
        joining = time.monotonic()
        if config.check_reachability:
            joined = await join_network(config.network, functools.partial(
                _offered_relays, checkpoint.model_uid, num_blocks))
        else:
            joined = Joined(await PeerNode.create(config.network, announcing=True),
                            "reachability: not checked (--no-reachability-check)")
        compute = ComputeWorker(config.device)
        compute.make_caller_serial()
        server = cls(config, checkpoint, joined, compute, plan)
        server.startup.add_network(joining, joined.node.join_seconds, config.check_reachability)
        try:
            await server._start(num_blocks)
        except BaseException:
            await server.shutdown()
            raise
        logger.info("Started in %s", server.startup)
        return server

    async def _start(self, num_blocks: int) -> None:
        if self.config.metrics_port is not None:  # first: a port in use fails before minutes of loading
            self.metrics_endpoint = MetricsEndpoint(self.metrics, self.config.metrics_host, self.config.metrics_port)
            logger.info("Metrics for Prometheus at %s", self.metrics_endpoint.url)
        if self.start is None:
            self.rebalancer = Rebalancer(self.current, self.model_uid, num_blocks, self.metrics,
                                         self.config.rebalance_period_s, self.config.move_delay_s)
            await asyncio.sleep(random.uniform(0, self.config.choice_delay_s))
            self.start, self.end = await self.rebalancer.choose(self.memory_plan.num_blocks, self.config.throughput)
            logger.info("Chose blocks %d:%d, where the swarm is weakest", self.start, self.end)
        # from now on other servers looking for gaps ask us what we serve (loading: joining)
        await self.current.serve(INFO_PROTOCOL, functools.partial(handle_info_stream, self.info, self.metrics))
        span = await self._load_while_joining()
        self.startup.lap("blocks and announcing joining")
        if not self.throughput:
            self.throughput = await self._measure_throughput(span)
        logger.info("Throughput: %.1f tokens/s per block", self.throughput)
        self.startup.lap("throughput")
        self.service = self._serve_span(span)
        self.metrics.watch(LiveState(  # read at each scrape: the span served then
            open_sessions=lambda: len(self.service.registry.sessions),
            queue_depth=lambda: self.service.scheduler.queue_depth,
            cache_tokens_used=lambda: self.service.budget.used_bytes // self.service.budget.bytes_per_token,
            cache_tokens_free=lambda: self.service.budget.tokens_left))
        self.startup.lap("attention cache")
        # a stream is served by the span served when it opens; pushed steps by the one served when they come
        await self.current.serve(INFERENCE_PROTOCOL, self._inference_stream)
        await self.current.serve(PUSH_PROTOCOL, functools.partial(handle_push_stream, self._backend, self.pusher))
        await self.current.serve(FORWARD_PROTOCOL, self._forward_stream)
        await self.current.serve(BACKWARD_PROTOCOL, self._forward_stream)
        self.state = ServerState.ONLINE
        await self.announce()
        self.startup.lap("announce")
        self._start_task(self._announce_periodically(), "bloompeer-announcer")
        self._start_task(self._measure_next_hops(num_blocks), "bloompeer-next-hops")
        if self.rebalancer is not None:
            self._start_task(self.rebalancer.run(self._served_span, self.move), "bloompeer-rebalancer")
        if self.current.relays is not None:
            keeper = RelayKeeper(self.current.relays, lambda: self.current.p2p, self._offered_relays, self._rejoin,
                                 lambda line: self.on_relays(line))
            self._start_task(keeper.run(), "bloompeer-relays")

    def _start_task(self, coroutine, name: str) -> None:
        task = asyncio.create_task(coroutine, name=name)
        task.add_done_callback(self._check_task)
        self._tasks.append(task)

    def _check_task(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s failed; the server stops", task.get_name(), exc_info=task.exception())
            self.failed.set()

    async def _offered_relays(self, exclude: list[str]) -> list[str]:
        return await _offered_relays(self.model_uid, self.checkpoint.config().num_hidden_layers, self.node, exclude)

    async def _rejoin(self, relays: RelaySlots) -> None:
        """Behind NAT, start the daemon again on these relays (the streams open now end), serve and announce."""
        await self.current.rejoin(behind_relays(self.config.network, relays), relays)
        self.pusher.close()  # its streams went with the old daemon
        await self.announce()

    @property
    def node(self) -> PeerNode:
        return self.current.node

    def _backend(self) -> SpanBackend:
        return self.service.backend

    async def _inference_stream(self, stream: IncomingStream) -> None:
        await handle_inference_stream(self.service.backend, self.pusher, stream)

    async def _forward_stream(self, stream: IncomingStream) -> None:
        await handle_forward_stream(self.service.backend, stream)

    async def _load_while_joining(self) -> BlockSpan:
        """Load blocks [start, end) in the compute thread (the loop, and the DHT node, stay responsive)
        while announcing them as joining, which costs no time."""
        load = functools.partial(self.checkpoint.load_span, self.start, self.end, getattr(torch, self.config.dtype),
                                 self.config.device, self.storage.block_hook())
        span, _ = await asyncio.gather(self.compute.run(load), self.announce())
        return span

    async def _measure_throughput(self, span: BlockSpan) -> float:
        """Measured once per model, device, dtype and torch version, then read from the cache; a quick
        estimate is only for this run."""
        config, dtype = self.config, getattr(torch, self.config.dtype)
        key = f"{self.fingerprint}|{config.device}|{config.dtype}|{torch.__version__}"
        if self.storage.kind != "none":
            key += f"|{self.storage.kind}|{self.storage.announced_group_size}"
        steps = QUICK_STEPS if config.quick_throughput else MEASURE_STEPS

        def measure() -> float:
            throughput = measure_throughput(span, config.device, dtype, steps)
            if config.quick_throughput:
                logger.info("Estimated the throughput in %d steps (--quick-throughput: not kept)", steps)
            return throughput

        return await self.compute.run(cached_throughput, key, measure, not config.quick_throughput, rows=1)

    def _serve_span(self, span: BlockSpan) -> SpanService:
        """Cache budget, sessions, scheduler and the backend that checks requests for them. The
        service accepts while this server is online and the service is the one it serves."""
        if self.config.max_batch_sessions != 1:
            span.use_batched_linears()
        service = SpanService(span, self.model_uid, self.config, self.compute, self.metrics,
                              accepting=lambda: self.state is ServerState.ONLINE and self.service is service)
        return service

    def _served_span(self) -> ServedSpan:
        return ServedSpan(self.node.peer_id_str, self.start, self.end, self.throughput)

    async def move(self, plan: Move) -> None:
        """Serve plan's blocks instead of the present ones: announce the new span joining at once
        (other servers looking for the same gap then see it taken) and the old one draining, give
        the open sessions up to the drain timeout to move elsewhere, free the old span, announce it
        offline, load the new one (only the shards that hold it) and announce it online."""
        old = self.service
        leaving = dataclasses.replace(self.record(), state=ServerState.DRAINING)
        only_old = [index for index in range(old.start, old.end) if not plan.start <= index < plan.end]
        logger.info("Moving from blocks %d:%d to %d:%d: %s", old.start, old.end, plan.start, plan.end, plan.reason)
        self.state, self.start, self.end = ServerState.JOINING, plan.start, plan.end
        self.on_move("moving", plan)
        await asyncio.gather(self.announce(), self.announce(leaving, only_old))
        left = await old.wait_for_sessions_to_leave(self.config.drain_timeout_s)
        if left:
            logger.info("Ending %d session(s) still open on blocks %d:%d; their clients replay them elsewhere",
                        left, old.start, old.end)
        await old.retire()
        await self.announce(dataclasses.replace(leaving, state=ServerState.OFFLINE), only_old)
        span = await self._load_while_joining()
        self.service = self._serve_span(span)
        self.state = ServerState.ONLINE
        await self.announce()
        self.metrics.moves.inc()
        logger.info("Serving blocks %d:%d", self.start, self.end)
        self.on_move("online", plan)

    def info(self) -> ServerInfo:
        service = self.service
        tokens_left, sessions = (service.budget.tokens_left, len(service.registry.sessions)) if service else (0, 0)
        return ServerInfo(self.model_uid, self.start, self.end, self.state.value, __version__, self.config.dtype,
                          tokens_left, sessions)

    def record(self) -> ServerRecord:
        return ServerRecord(
            peer_id=self.node.peer_id_str, state=self.state, start=self.start, end=self.end,
            throughput=self.throughput, cache_tokens_left=self.service.budget.tokens_left if self.service else 0,
            dtype=self.config.dtype, version=__version__, weights_fingerprint=self.fingerprint,
            relayed=self.current.relays is not None, relay_maddrs=announceable(self.current.relay_maddrs),
            via_relays=self.current.relays.announced() if self.current.relays is not None else (),
            limits=RequestLimits(self.config.max_batch, self.config.max_length, self.config.max_step_tokens),
            push_rtts_s=self.push_rtts.announced(), family=self.checkpoint.family.name,
            quant=self.storage.kind, quant_group_size=self.storage.announced_group_size,
            device=torch.device(self.config.device).type,
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
            again = " (will retry)" if (record.start, record.end) == (self.start, self.end) else ""
            logger.warning("Could not announce %s blocks %d:%d as %s on the DHT%s",
                           self.model_uid, blocks[0], blocks[-1] + 1, record.state.value, again)
        return ok

    async def _announce_periodically(self) -> None:
        """Refresh the record every period, and once soon after going online: the first store went to
        the peers that a young routing table knew, and servers that joined at the same moment may be
        nearer the keys by now, where lookups go; without it a lookup could miss the server for a period."""
        await asyncio.sleep(min(REANNOUNCE_AFTER_JOINING_S, self.config.announce_period_s))
        while True:
            await self.announce()
            await asyncio.sleep(self.config.announce_period_s)

    async def _measure_next_hops(self, num_blocks: int) -> None:
        """Keep round trips to the servers we could push to fresh; announce at once when the set changes."""
        while True:
            try:
                servers = await self.node.directory.find_servers(self.model_uid, num_blocks)
                self.metrics.count_dht("lookup", num_blocks)
                if await self.push_rtts.refresh(servers, self.start, self.end) and self.state is ServerState.ONLINE:
                    await self.announce()
            except Exception:
                logger.warning("Could not measure the round trips to the next servers", exc_info=True)
            await asyncio.sleep(NEXT_HOPS_CHECK_S)

    async def drain(self, timeout_s: float) -> None:
        """Take no new sessions, tell the open ones to move (their next step is refused), and wait
        up to `timeout_s` in all (announcing draining included) for them to go. 0: no drain at all."""
        if self.state is not ServerState.ONLINE or not self.node.daemon_alive or timeout_s <= 0:
            return
        self.state = ServerState.DRAINING
        deadline = asyncio.get_running_loop().time() + timeout_s
        await _within(timeout_s, "announcing draining", self.node.unless_daemon_gone(self.announce()))
        left = await self.service.wait_for_sessions_to_leave(max(0.0, deadline - asyncio.get_running_loop().time()))
        logger.info("Drained: %s", f"{left} session(s) still open after {timeout_s:.0f} s" if left
                    else "no sessions left")

    async def _say_goodbye(self) -> None:
        await self.announce()
        await self.current.stop_serving()

    async def shutdown(self) -> None:
        """Announce offline and release everything. Idempotent, and bounded in time (a stopped server
        exits even when its daemon or the peers it tells hang): a step waiting on tasks or on other
        peers gets STOP_STEP_S, then the shutdown goes on without it."""
        if self.state is ServerState.OFFLINE:
            return
        was_announced = self.start is not None
        self.state = ServerState.OFFLINE
        for task in self._tasks:
            task.cancel()
        stopping = [*self._tasks, *([self.service.stop_tasks()] if self.service is not None else [])]
        await _within(STOP_STEP_S, "stopping background tasks", asyncio.gather(*stopping, return_exceptions=True))
        try:
            if was_announced:
                await _within(STOP_STEP_S, "announcing offline", self.node.unless_daemon_gone(self._say_goodbye()))
        finally:
            if self.metrics_endpoint is not None:
                self.metrics_endpoint.close()
            self.pusher.close()
            await self.node.shutdown()
            self.compute.shutdown()


async def _within(timeout_s: float, step: str, awaitable: Awaitable[object]) -> None:
    """Await a step of stopping for at most `timeout_s`, then go on without it (and say so)."""
    try:
        await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        logger.warning("Stopping: %s took over %.0f s; going on without it", step, timeout_s)


async def _offered_relays(model_uid: str, num_blocks: int, node: PeerNode, exclude: Sequence[str] = ()) -> list[str]:
    """Relays that servers of this model offer in their records (none of `exclude`, nor us)."""
    servers = await node.directory.find_servers(model_uid, num_blocks)
    records = (record for records in servers.values() for record in records)
    return relays_in_records(records, [*exclude, node.peer_id_str])
