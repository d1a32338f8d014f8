"""The blocks a server serves now, and everything that serves them: the attention-cache budget, the
open sessions, the scheduler feeding the compute thread, and the backend that checks requests.

A server has one. A server that moves to other blocks (`--num-blocks`, rebalancer.py) retires it,
which frees its weights and caches before the next span is loaded, and then starts another.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable

from ...blocks import BlockSpan
from .backend import SpanBackend
from .compute import ComputeWorker
from .config import ServerConfig
from .cache_budget import CacheBudget
from .metrics import ServerMetrics
from .scheduler import Scheduler
from .sessions import SessionRegistry

__all__ = ["SpanService"]

logger = logging.getLogger(__name__)


class SpanService:
    """Serves blocks [span.start, span.end) until retired; accepts requests while `accepting()` says
    so and it is not retired (a retired one refuses every request, whoever still holds it)."""

    def __init__(self, span: BlockSpan, model_uid: str, config: ServerConfig, cache_bytes: int,
                 compute: ComputeWorker, metrics: ServerMetrics, accepting: Callable[[], bool]):
        """cache_bytes: the attention cache's budget, the memory plan's (MemoryPlan.cache_bytes)."""
        self.span, self.retired = span, False
        dtype = config.torch_dtype
        self.budget = CacheBudget(cache_bytes, *span.cache_costs(span.start, span.end, dtype))
        logger.info("Session cache: %.1f MiB, %s", cache_bytes / 2**20, self.budget.room())
        self.registry = SessionRegistry(self.budget, config.max_sessions_per_peer, config.session_timeout_s)
        self.scheduler = Scheduler(span, compute, config.max_batch_tokens, config.device, dtype,
                                   config.max_batch_sessions, metrics, config.batch_wait_s)
        self.backend = SpanBackend(span, model_uid, config, self.registry, self.scheduler,
                                   accepting=lambda: not self.retired and accepting(), metrics=metrics)
        self._tasks = [asyncio.create_task(self.scheduler.run(), name="bloompeer-scheduler"),
                       asyncio.create_task(self.registry.expire_idle(), name="bloompeer-session-reaper")]

    @property
    def start(self) -> int:
        return self.span.start

    @property
    def end(self) -> int:
        return self.span.end

    async def wait_for_sessions_to_leave(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the open sessions to close (their clients, refused, move on);
        returns how many are still open."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.registry.sessions and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return len(self.registry.sessions)

    async def retire(self) -> None:
        """Refuse everything from now on, end the sessions still open (their streams close, so their
        clients replay elsewhere at once), let the pass running now finish, and free the weights
        and caches. Idempotent."""
        if self.retired:
            return
        self.retired = True
        for session in list(self.registry.sessions):
            session.on_expire()
            await self.registry.close(session)
        await self.scheduler.stop()
        await self.stop_tasks()
        # A stream that outlives its session may still hold the backend, and with it the span: the
        # tensors go now, whatever holds the module (a retired backend refuses all work anyway).
        self.span.batched_linears = None
        self.span.to_empty(device="meta")
        gc.collect()

    async def stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
