"""The FastAPI app of `bloompeer api`: OpenAI's /v1 endpoints, the dashboard at /, /metrics and
/health (200 while every block has a usable server, else 503: for load balancers, orchestrators'
readiness probes and compose health checks; it needs no key).

One distributed causal LM (of any family) serves every request; each request's generate() runs on a
thread of a bounded pool (see generation.py). The pool's size bounds the sessions this client
opens at once, which servers also limit per client (`--max-sessions-per-peer`, 16 by default);
requests beyond it wait for a thread.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from .auth import HEALTH_PATH, ApiAccess, RequireApiKey
from .completions import add_completion_routes
from .constrained import GrammarCompiler
from .dashboard import add_dashboard_routes
from .errors import ApiError, install_error_handlers
from .generation import eos_ids
from .metrics import ApiMetrics
from .openai_schema import model_list
from .response_store import ResponseStore
from .responses import add_response_routes
from .swarm_state import fetch_swarm_state, fetch_unserved_blocks

__all__ = ["ApiState", "create_app"]

DEFAULT_MAX_CONCURRENT_GENERATIONS = 16  # servers' default --max-sessions-per-peer


@dataclass
class ApiState:
    """What every request handler shares: the model, its tokenizer and names, metrics, threads."""

    model: object  # a DistributedCausalLMMixin model (DistributedBloomForCausalLM, DistributedLlamaForCausalLM)
    tokenizer: object
    model_id: str  # as /v1/models lists it: the checkpoint's name, under which the swarm serves it
    aliases: frozenset[str] = frozenset()  # other names a request may use, e.g. the --model path as given
    max_concurrent_generations: int = DEFAULT_MAX_CONCURRENT_GENERATIONS
    access: ApiAccess = ApiAccess()  # who may use it: API keys, and whether the dashboard is public
    metrics: ApiMetrics = field(default_factory=ApiMetrics)
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.pool = _CountingPool(self.max_concurrent_generations, self.metrics.busy_threads)

    def check_model(self, name: str) -> None:
        if name != self.model_id and name not in self.aliases:
            raise ApiError(404, f"this server does not serve model {name!r}; it serves {self.model_id!r} "
                                f"(see GET /v1/models)", param="model", code="model_not_found")

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """The tokenizer read by the grammar library (0.01 to 0.6 s, by vocabulary), at the first request
        that constrains its reply; call it off the event loop."""
        return GrammarCompiler(self.tokenizer, self.model.config.vocab_size, eos_ids(self.model))

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class _CountingPool(ThreadPoolExecutor):
    """The generation threads, counting those at work in a gauge: what shows that the work of a request
    whose client left was stopped (its thread is free again), not only that nobody reads it."""

    def __init__(self, size: int, busy):
        super().__init__(size, thread_name_prefix="bloompeer-generate")
        self.busy = busy

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(self._counted, fn, *args, **kwargs)

    def _counted(self, fn, *args, **kwargs):
        with self.busy.track_inprogress():
            return fn(*args, **kwargs)


class _CountRequests:
    """ASGI middleware: bloompeer_api_requests_total by endpoint (route path) and status code.

    A request is counted as its response starts, so that a client which has read a response
    (a stream too, whose last frames may still be on their way out) finds it counted; one that
    fails before any response counts as a 500. Plain ASGI rather than BaseHTTPMiddleware, which
    would get between a streaming response and the client's disconnect."""

    def __init__(self, app, metrics: ApiMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        def count(code: int) -> None:
            route = scope.get("route")
            endpoint = route.path if route is not None and hasattr(route, "path") else "other"
            self.metrics.requests.labels(endpoint, str(code)).inc()

        async def send_counting(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            if not started:
                count(500)


def create_app(state: ApiState) -> FastAPI:
    app = FastAPI(title="bloompeer", summary="An OpenAI-compatible API over a bloompeer swarm",
                  docs_url="/docs", redoc_url=None)
    app.state.api = state
    install_error_handlers(app)
    app.add_middleware(RequireApiKey, access=state.access)
    app.add_middleware(_CountRequests, metrics=state.metrics)  # outermost: refused requests are counted too

    @app.get("/v1/models")
    async def models() -> dict:
        swarm = await fetch_swarm_state(state.model)
        return model_list([(state.model_id, swarm["missing"], swarm["weights"])], state.created)

    add_completion_routes(app, state)
    add_response_routes(app, state)
    add_dashboard_routes(app, state)

    @app.get(HEALTH_PATH)
    async def health() -> JSONResponse:
        unserved = await fetch_unserved_blocks(state.model)
        body = {"status": "unavailable" if unserved else "ok", "model": state.model_id, "missing_blocks": unserved}
        return JSONResponse(body, status_code=503 if unserved else 200)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        body, content_type = state.metrics.exposition()
        return Response(body, media_type=content_type)

    return app
