"""`bloompeer api`: the HTTP server's command line, start-up and shutdown.

Start-up: a local swarm if no peers are given (as `generate` does), the client model, a first
look at the swarm (so the dashboard has latencies at once), then uvicorn on a socket bound here
(so --port 0 works and the real port is printed). "api: http://HOST:PORT/v1" on stdout means it
answers. SIGINT/SIGTERM stop uvicorn (streams get a few seconds), then the model and the swarm;
the exit code is then 0 for SIGTERM, 130 for SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket

from .arguments import port, positive_int
from .flags import add_api_access_flags, add_client_flags, add_model_flag, api_access, client_config, initial_peers
from .import_gc import imports_without_gc
from .local_swarm import start_local_swarm

__all__ = ["add_parser", "run"]

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0  # open streams get this long at SIGTERM


def add_parser(commands) -> None:
    api = commands.add_parser(
        "api", help="serve an OpenAI-compatible HTTP API (and a swarm dashboard) through the swarm",
        description="Serve /v1/models, /v1/completions and /v1/chat/completions (OpenAI's API, streaming "
                    "included), a swarm dashboard at / and Prometheus metrics at /metrics. This process is a "
                    "client of the swarm (it opens no p2p port); with no --initial-peers (and no "
                    "$BLOOMPEER_INITIAL_PEERS) it starts a local swarm of the model and stops it at exit.")
    add_model_flag(api, "; requests name it by its last path component (GET /v1/models lists it)")
    api.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    api.add_argument("--port", type=port, default=8000, help="HTTP port (default: 8000; 0: any free port)")
    api.add_argument("--max-concurrent", type=positive_int, default=16, metavar="N",
                     help="generations running at once, each its own session on the servers (16, the servers' "
                          "default --max-sessions-per-peer); more requests wait their turn")
    add_api_access_flags(api)
    add_client_flags(api)  # --timeout: how long a request waits for missing blocks before it is answered 503


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def run(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so the ExitStack stops the model and the local swarm. While
    # serving, uvicorn handles it (a graceful shutdown), then raises it again, into this handler.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    access = api_access(args)
    _warn_if_open(args.host, access)
    try:
        with contextlib.ExitStack() as stack:
            peers = initial_peers(args) or tuple(start_local_swarm(args.model, stack).initial_peers)
            app = _build_app(args, peers, access, stack)
            _serve(app, args.host, args.port)
        return 0
    except KeyboardInterrupt:
        return 130


def _warn_if_open(host: str, access) -> None:
    from ..api.auth import is_loopback

    if not access.keys and not is_loopback(host):
        logger.warning("the API listens on %s with no API key: anyone who can reach this port can use the swarm "
                       "through it (and see the dashboard). Set one with --api-key KEY or $BLOOMPEER_API_KEY.", host)


def _build_app(args: argparse.Namespace, peers: tuple[str, ...], access, stack: contextlib.ExitStack):
    with imports_without_gc():
        from transformers import AutoTokenizer

        from ..client.auto import AutoDistributedModelForCausalLM
        from ..api.app import ApiState, create_app

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = stack.enter_context(AutoDistributedModelForCausalLM.from_pretrained(
        args.model, client_config=client_config(args, peers)))
    model.client.runtime.run(model.client.swarm.refresh())
    state = ApiState(model, tokenizer, model.client.swarm.model_uid, aliases=frozenset({args.model}),
                     max_concurrent_generations=args.max_concurrent, access=access)
    stack.callback(state.shutdown)
    return create_app(state)


def _serve(app, host: str, port: int) -> None:
    import uvicorn

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                bound_port = sockets[0].getsockname()[1]
                url_host = f"[{host}]" if ":" in host else host
                print(f"api: http://{url_host}:{bound_port}/v1", flush=True)

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    config = uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    AnnouncingServer(config).run(sockets=[sock])
