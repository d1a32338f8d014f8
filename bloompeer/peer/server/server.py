"""A running server: the owner of its parts' lifetimes, and of the order they start and stop in.

Lifecycle: joining (network up, weights loading) -> online (serving) -> draining (SIGTERM: no new
sessions; open ones are told to move) -> offline (announced, then shut down). Each part does one
job: CurrentNode is the network peer now (replaced when a server behind NAT rejoins), Announcer
keeps the DHT record, SpanService serves the span of now (cache, sessions, scheduler), Rebalancer
moves the server where the swarm needs it (--num-blocks), RelayKeeper keeps it reachable behind
NAT, and handlers.py answers the streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence

from ..._version import __version__
from ...blocks import BlockSpan, Checkpoint, open_checkpoint, quantize_block
from ...p2p import INFO_PROTOCOL, PeerNode, RelaySlots, ServerInfo, ServerState, relays_in_records
from .announcer import Announcer, Standing
from .block_choice import Move, ServedSpan
from .compute import ComputeWorker, check_device
from .config import ServerConfig
from .current_node import CurrentNode
from .handlers import handle_info_stream, serve_requests
from .memory_plan import MemoryPlan, plan_memory
from .metrics import LiveState, MetricsEndpoint, ServerMetrics
from .push import PushSender
from .reachability import Joined, behind_relays, join_network
from .rebalancer import Rebalancer
from .relay_keeper import RelayKeeper
from .span_service import SpanService
from .stored_blocks import StoredBlocks
from .startup_clock import StartupClock
from .throughput import server_throughput

__all__ = ["Server"]

logger = logging.getLogger(__name__)

STOP_STEP_S = 3.0  # the most each step of a shutdown waits (Server.shutdown)


class Server:
    """One volunteer's contribution: a contiguous span of blocks, served to whoever asks, for as long
    as the process runs (and, with --num-blocks, moved to other blocks when the swarm needs them).

    It owns everything with the server's lifetime (network peer, compute thread, the span served
    now, announcer, rebalancer) so that shutdown can release them in one defined order: stop the
    background tasks, say goodbye on the DHT while the daemon still lives, then close the network
    and the compute thread. Handlers get the parts they need, never the Server, so the
    request path has no way to reach into the lifecycle.
    """

    def __init__(self, config: ServerConfig, checkpoint: Checkpoint, joined: Joined, compute: ComputeWorker,
                 memory_plan: MemoryPlan, num_model_blocks: int):
        self.config, self.checkpoint, self.compute = config, checkpoint, compute
        self.model_uid, self.num_model_blocks = checkpoint.model_uid, num_model_blocks
        # the node now (a rejoin behind NAT replaces it): every part reads it there, none keeps it
        self.current = CurrentNode(joined.node, joined.relays, joined.reachable if joined.node.relaying else ())
        self.reachability = joined.line
        self.start, self.end = config.start, config.end
        self.memory_plan = memory_plan  # made before anything started: how many blocks, in what memory
        self.throughput = config.throughput or 0.0
        self.state = ServerState.JOINING
        self.service: SpanService | None = None  # the span served now (a retired one during a move)
        self.rebalancer: Rebalancer | None = None  # with --num-blocks
        self.metrics = ServerMetrics()
        self.metrics_endpoint: MetricsEndpoint | None = None  # with --metrics-port
        self.announcer = Announcer(self.current, config, checkpoint, self.standing, self.metrics)
        self.pusher = PushSender(self.current)
        self.on_move: Callable[[str, Move], None] = lambda stage, plan: None  # "moving", then "online"
        self.on_relays: Callable[[str], None] = lambda line: None  # a relay left and others replaced it
        self.failed = asyncio.Event()  # a background task that cannot go on (a move that could not load)
        self._tasks: list[asyncio.Task] = []  # announcer, next hops, rebalancer, relay keeper
        self.startup = StartupClock()

    @property
    def node(self) -> PeerNode:
        """The peer node now (behind NAT, the one of the latest rejoin)."""
        return self.current.node

    @classmethod
    async def create(cls, config: ServerConfig) -> Server:
        """Join the network, load the blocks, register the handlers and announce online."""
        check_device(config.device)
        checkpoint = open_checkpoint(config.model)
        num_model_blocks = _check_blocks(config, checkpoint)
        StoredBlocks(checkpoint, config.weights).check(config.device)
        wanted = range(config.start, config.end) if config.start is not None else config.num_blocks_to_serve or None
        plan = plan_memory(config, checkpoint, wanted)  # before the network: a refusal costs nothing
        logger.info("Memory plan: %s", plan)
        joining = time.monotonic()
        joined = await _join(config, checkpoint.model_uid, num_model_blocks)
        compute = ComputeWorker(config.device)
        compute.make_caller_serial()
        server = cls(config, checkpoint, joined, compute, plan, num_model_blocks)
        server.startup.add_network(joining, joined.node.join_seconds, config.check_reachability)
        try:
            await server._start()
        except BaseException:
            await server.shutdown()
            raise
        logger.info("Started in %s", server.startup)
        return server

    async def _start(self) -> None:
        if self.config.metrics_port is not None:  # first: a port in use fails before minutes of loading
            self.metrics_endpoint = MetricsEndpoint(self.metrics, self.config.metrics_host, self.config.metrics_port)
            logger.info("Metrics for Prometheus at %s", self.metrics_endpoint.url)
        if self.start is None:
            await self._choose_blocks()
        # from now on other servers looking for gaps ask us what we serve (loading: joining)
        await self.current.serve(INFO_PROTOCOL, functools.partial(handle_info_stream, self.info, self.metrics))
        span = await self._load_while_joining()
        self.startup.lap("blocks and announcing joining")
        if not self.throughput:
            self.throughput = await server_throughput(span, self.config, self.checkpoint, self.compute)
        logger.info("Throughput: %.1f tokens/s per block", self.throughput)
        self.startup.lap("throughput")
        self.service = self._serve_span(span)
        self._watch_metrics()
        self.startup.lap("attention cache")
        await serve_requests(self.current, lambda: self.service.backend, self.pusher)
        self.state = ServerState.ONLINE
        await self.announcer.announce()
        self.startup.lap("announce")
        self._start_background_tasks()

    async def _choose_blocks(self) -> None:
        """--num-blocks: where the swarm is weakest, after a random wait (servers started together differ)."""
        self.rebalancer = Rebalancer(self.current, self.model_uid, self.num_model_blocks, self.metrics,
                                     self.config.rebalance_period_s, self.config.move_delay_s)
        await asyncio.sleep(random.uniform(0, self.config.choice_delay_s))
        self.start, self.end = await self.rebalancer.choose(self.memory_plan.num_blocks, self.config.throughput)
        logger.info("Chose blocks %d:%d, where the swarm is weakest", self.start, self.end)

    def _watch_metrics(self) -> None:
        """Gauges of the span served, read at each scrape (a move replaces the span)."""
        self.metrics.watch(LiveState(
            open_sessions=lambda: len(self.service.registry.sessions),
            queue_depth=lambda: self.service.scheduler.queue_depth,
            cache_tokens_used=lambda: self.service.budget.used_bytes // self.service.budget.bytes_per_token,
            cache_bytes_used=lambda: self.service.budget.used_bytes,
            cache_tokens_free=lambda: self.service.budget.tokens_left))

    def _start_background_tasks(self) -> None:
        self._start_task(self.announcer.run(), "bloompeer-announcer")
        self._start_task(self.announcer.measure_next_hops(), "bloompeer-next-hops")
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
        return await _offered_relays(self.model_uid, self.num_model_blocks, self.node, exclude)

    async def _rejoin(self, relays: RelaySlots) -> None:
        """Behind NAT, start the daemon again on these relays (the streams open now end), serve and announce."""
        await self.current.rejoin(behind_relays(self.config.network, relays), relays)
        self.pusher.close()  # its streams went with the old daemon
        await self.announcer.announce()

    async def _load_while_joining(self) -> BlockSpan:
        """Load blocks [start, end) in the compute thread (the loop, and the DHT node, stay responsive)
        while announcing them as joining, which costs no time."""
        load = functools.partial(self.checkpoint.load_span, self.start, self.end, self.config.torch_dtype,
                                 self.config.device, functools.partial(quantize_block, weights=self.config.weights))
        span, _ = await asyncio.gather(self.compute.run(load), self.announcer.announce())
        return span

    def _serve_span(self, span: BlockSpan) -> SpanService:
        """Cache budget, sessions, scheduler and the backend that checks requests for them. The
        service accepts while this server is online and the service is the one it serves."""
        if self.config.max_batch_sessions != 1:
            span.use_batched_linears()
        service = SpanService(span, self.model_uid, self.config, self.memory_plan.cache_bytes, self.compute,
                              self.metrics, accepting=lambda: self.state is ServerState.ONLINE and self.service is service)
        return service

    def _served_span(self) -> ServedSpan:
        return ServedSpan(self.node.peer_id_str, self.start, self.end, self.throughput)

    def standing(self) -> Standing:
        """Where the server stands now, as its record says (announcer.py)."""
        tokens_left = self.service.budget.tokens_left if self.service is not None else 0
        return Standing(self.state, self.start, self.end, self.throughput, tokens_left)

    def info(self) -> ServerInfo:
        service = self.service
        tokens_left, sessions = (service.budget.tokens_left, len(service.registry.sessions)) if service else (0, 0)
        return ServerInfo(self.model_uid, self.start, self.end, self.state.value, __version__, self.config.dtype,
                          tokens_left, sessions)

    async def move(self, plan: Move) -> None:
        """Serve plan's blocks instead of the present ones: announce the new span joining at once
        (other servers looking for the same gap then see it taken) and the old one draining, give
        the open sessions up to the drain timeout to move elsewhere, free the old span, announce it
        offline, load the new one (only the shards that hold it) and announce it online."""
        old, announcer = self.service, self.announcer
        leaving = dataclasses.replace(announcer.record(), state=ServerState.DRAINING)
        only_old = [index for index in range(old.start, old.end) if not plan.start <= index < plan.end]
        logger.info("Moving from blocks %d:%d to %d:%d: %s", old.start, old.end, plan.start, plan.end, plan.reason)
        self.state, self.start, self.end = ServerState.JOINING, plan.start, plan.end
        self.on_move("moving", plan)
        await asyncio.gather(announcer.announce(), announcer.announce(leaving, only_old))
        left = await old.wait_for_sessions_to_leave(self.config.drain_timeout_s)
        if left:
            logger.info("Ending %d session(s) still open on blocks %d:%d; their clients replay them elsewhere",
                        left, old.start, old.end)
        await old.retire()
        await announcer.announce(dataclasses.replace(leaving, state=ServerState.OFFLINE), only_old)
        span = await self._load_while_joining()
        self.service = self._serve_span(span)
        self.state = ServerState.ONLINE
        await announcer.announce()
        self.metrics.moves.inc()
        logger.info("Serving blocks %d:%d", self.start, self.end)
        self.on_move("online", plan)

    async def drain(self, timeout_s: float) -> None:
        """Take no new sessions, tell the open ones to move (their next step is refused), and wait
        up to `timeout_s` in all (announcing draining included) for them to go. 0: no drain at all."""
        if self.state is not ServerState.ONLINE or not self.node.daemon_alive or timeout_s <= 0:
            return
        self.state = ServerState.DRAINING
        deadline = asyncio.get_running_loop().time() + timeout_s
        await _within(timeout_s, "announcing draining", self.node.unless_daemon_gone(self.announcer.announce()))
        left = await self.service.wait_for_sessions_to_leave(max(0.0, deadline - asyncio.get_running_loop().time()))
        logger.info("Drained: %s", f"{left} session(s) still open after {timeout_s:.0f} s" if left
                    else "no sessions left")

    async def _say_goodbye(self) -> None:
        await self.announcer.announce()
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


def _check_blocks(config: ServerConfig, checkpoint: Checkpoint) -> int:
    """The model's number of blocks, once the blocks asked for (--blocks or --num-blocks) are within it."""
    num_model_blocks, model = checkpoint.config().num_hidden_layers, checkpoint.model_uid
    if config.start is not None and not 0 <= config.start < config.end <= num_model_blocks:
        raise ValueError(f"--blocks {config.start}:{config.end} is not a range within {model}'s "
                         f"{num_model_blocks} blocks (0:{num_model_blocks})")
    count = config.num_blocks_to_serve
    if config.start is None and not 0 <= count <= num_model_blocks:
        raise ValueError(f"--num-blocks {count} is not between 1 and {model}'s {num_model_blocks} blocks")
    return num_model_blocks


async def _join(config: ServerConfig, model_uid: str, num_model_blocks: int) -> Joined:
    """Join the network: directly if a peer can dial us back, else through relays the swarm offers."""
    if config.check_reachability:
        return await join_network(config.network, functools.partial(_offered_relays, model_uid, num_model_blocks))
    return Joined(await PeerNode.create(config.network, announcing=True),
                  "reachability: not checked (--no-reachability-check)")


async def _within(timeout_s: float, step: str, awaitable: Awaitable[object]) -> None:
    """Await a step of stopping for at most `timeout_s`, then go on without it (and say so)."""
    try:
        await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        logger.warning("Stopping: %s took over %.0f s; going on without it", step, timeout_s)


async def _offered_relays(model_uid: str, num_model_blocks: int, node: PeerNode,
                          exclude: Sequence[str] = ()) -> list[str]:
    """Relays that servers of this model offer in their records (none of `exclude`, nor us)."""
    servers = await node.directory.find_servers(model_uid, num_model_blocks)
    records = (record for records in servers.values() for record in records)
    return relays_in_records(records, [*exclude, node.peer_id_str])
