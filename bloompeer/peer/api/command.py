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
import dataclasses
import logging
import signal
import socket

from ..default_model import DEMO_MODEL_DIR
from ..flags import model_argument

__all__ = ["add_api_parser", "run_api"]

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0  # open streams get this long at SIGTERM


def add_api_parser(commands, add_network_flags) -> None:
    api = commands.add_parser(
        "api", help="serve an OpenAI-compatible HTTP API (and a swarm dashboard) through the swarm",
        description="Serve /v1/models, /v1/completions and /v1/chat/completions (OpenAI's API, streaming "
                    "included), a swarm dashboard at / and Prometheus metrics at /metrics. This process is a "
                    "client of the swarm (it opens no p2p port); with no --initial-peers (and no "
                    "$BLOOMPEER_INITIAL_PEERS) it starts a local swarm of the model and stops it at exit.")
    api.add_argument("--model", default=str(DEMO_MODEL_DIR), type=model_argument,
                     help="local checkpoint directory or hub name (default: the bundled demo model); requests "
                          "name it by its last path component (GET /v1/models lists it)")
    api.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    api.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000; 0: any free port)")
    api.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                     help="how long a request waits for servers of missing blocks before it is answered 503 (60)")
    api.add_argument("--max-concurrent", type=int, default=16, metavar="N",
                     help="generations running at once, each its own session on the servers (16, the servers' "
                          "default --max-sessions-per-peer); more requests wait their turn")
    add_network_flags(api, "/ip4/127.0.0.1/tcp/0")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def run_api(args: argparse.Namespace, network) -> int:
    """Called by cli.main only. network: the NetworkConfig built from the network flags (client mode)."""
    from ...p2p import BloompeerError

    if args.max_concurrent < 1:
        logger.error("--max-concurrent must be at least 1")
        return 1
    # SIGTERM unwinds like Ctrl-C, so the ExitStack stops the model and the local swarm. While
    # serving, uvicorn handles it (a graceful shutdown), then raises it again, into this handler.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with contextlib.ExitStack() as stack:
            if not network.initial_peers:
                from ..generate_command import _start_local_swarm

                network = dataclasses.replace(network, initial_peers=_start_local_swarm(args.model, stack))
            app = _build_app(args, network, stack)
            _serve(app, args.host, args.port)
        return 0
    except KeyboardInterrupt:
        return 130
    except (BloompeerError, ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 1


def _build_app(args: argparse.Namespace, network, stack: contextlib.ExitStack):
    from transformers import AutoTokenizer

    from ..client.config import ClientConfig
    from ..client.model import DistributedBloomForCausalLM
    from .app import ApiState, create_app

    config = ClientConfig(network=network, missing_blocks_timeout_s=args.timeout)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = stack.enter_context(DistributedBloomForCausalLM.from_pretrained(args.model, client_config=config))
    model.client.runtime.run(model.client.swarm.refresh())
    state = ApiState(model, tokenizer, model.client.swarm.model_uid, aliases=frozenset({args.model}),
                     max_concurrent_generations=args.max_concurrent)
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
