"""The `bloompeer` command: dht (bootstrap peer), serve (blocks), generate (client).

Results go to stdout (multiaddrs, the "online" line, generated text); logs go to stderr.
This is the only place that configures logging, signals and the event loop policy.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from .. import _version
from .default_model import DEMO_MODEL_DIR
from .flags import add_network_flags, check_blocks_within_model, model_argument, network_config
from .local_swarm import EXIT_WITH_PARENT_ENV

__all__ = ["main", "build_parser"]

logger = logging.getLogger("bloompeer")

def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    from .server.config import ServerConfig

    defaults = ServerConfig(model="", start=None, end=None)
    group = parser.add_argument_group("capacity and limits (what one server gives its clients)")
    group.add_argument("--cache-tokens", type=int, default=None, metavar="N",
                       help="attention cache for all sessions together, in tokens over the served blocks; a new "
                            "session reserves batch x max_length of it (default: half the free memory)")
    group.add_argument("--session-timeout", type=float, default=defaults.session_timeout_s, metavar="SECONDS",
                       help=f"close a session after this long without a step ({defaults.session_timeout_s:.0f})")
    group.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens, metavar="N",
                       help="rows (batch x tokens) computed in one pass; sessions' steps are batched up to it and "
                            f"longer prompts run in chunks ({defaults.max_batch_tokens})")
    group.add_argument("--max-batch-sessions", type=int, default=None, metavar="N",
                       help="at most N sessions' steps share one pass (default: as many as fit in "
                            "--max-batch-tokens); 1 turns batching across sessions off")
    group.add_argument("--max-step-tokens", type=int, default=defaults.max_step_tokens, metavar="N",
                       help=f"rows (batch x tokens) one request may send ({defaults.max_step_tokens})")
    group.add_argument("--max-batch", type=int, default=defaults.max_batch, metavar="N",
                       help=f"sequences (rows) one session or forward may have ({defaults.max_batch})")
    group.add_argument("--max-length", type=int, default=defaults.max_length, metavar="N",
                       help=f"tokens one session may hold, prompt and output ({defaults.max_length})")
    group.add_argument("--max-sessions-per-peer", type=int, default=defaults.max_sessions_per_peer, metavar="N",
                       help=f"sessions one client may have open at once ({defaults.max_sessions_per_peer})")
    group.add_argument("--max-frame-mb", type=float, default=defaults.max_frame_bytes / 2**20, metavar="MB",
                       help=f"largest frame accepted ({defaults.max_frame_bytes / 2**20:.0f} MiB)")
    group.add_argument("--throughput", type=float, default=None, metavar="TOKENS_PER_S",
                       help="announce this decode throughput (tokens/s through one block) instead of measuring it "
                            "at start (measured once per model, device and dtype, then kept in the cache directory)")
    group.add_argument("--quick-throughput", action="store_true",
                       help="estimate the throughput from a few steps and keep it nowhere (for a swarm that lives "
                            "for one command; `generate` starts its local swarm so)")
    group.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout_s, metavar="SECONDS",
                       help="on SIGTERM or Ctrl-C, how long open sessions get to move elsewhere before the server "
                            f"exits ({defaults.drain_timeout_s:.0f}); a second signal exits at once")


def _block_range(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a block range like 0:8") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"{text!r} is empty: it means blocks start..end-1, so start < end")
    return start, end


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bloompeer", description="Run BLOOM language models collaboratively: volunteers serve transformer "
                                      "blocks, users generate text through the swarm.")
    parser.add_argument("--version", action="version", version=f"bloompeer {_version.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details (and hivemind's INFO)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    dht = commands.add_parser("dht", help="run a bootstrap peer that others join through",
                              description="Run a bootstrap peer. Prints its multiaddrs, one per line: give one "
                                          "of them to servers and clients with --initial-peers. It also relays "
                                          "for servers behind NAT (up to 16 GiB and 24 h per connection), so "
                                          "run it where it can be reached: a public IP, or a forwarded port "
                                          "with --announce-maddrs.")
    dht.add_argument("--maddrs-file", metavar="FILE", default=None,
                     help="also write the multiaddrs to FILE once the peer is up (for scripts and containers)")
    add_network_flags(dht, "/ip4/0.0.0.0/tcp/0").add_argument(
        "--no-relay", action="store_true", help="do not relay for peers behind NAT (e.g. a swarm on one machine)")

    serve = commands.add_parser("serve", help="serve a range of a model's blocks to the swarm",
                                description="Load blocks A..B-1 of a BLOOM model and serve them to the swarm until "
                                            "interrupted (SIGINT or SIGTERM), then announce offline and exit.")
    serve.add_argument("--model", default=str(DEMO_MODEL_DIR), type=model_argument,
                       help="local checkpoint directory or Hugging Face hub name (default: the bundled demo model)")
    which = serve.add_mutually_exclusive_group(required=True)
    which.add_argument("--blocks", type=_block_range, metavar="A:B", help="serve blocks A..B-1, e.g. 0:8")
    which.add_argument("--num-blocks", type=int, metavar="K",
                       help="serve K consecutive blocks, chosen where the swarm has the least throughput")
    serve.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ... (default: cpu)")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                       help="compute and cache dtype (default: float32)")
    _add_limit_flags(serve)
    network = add_network_flags(serve, "/ip4/0.0.0.0/tcp/0")
    network.add_argument("--no-relay", action="store_true",
                         help="do not relay traffic for peers behind NAT (by default a directly reachable server "
                              "relays for them, up to 16 GiB and 24 h per connection). A server that cannot be "
                              "reached itself is served through its --initial-peers in any case")
    network.add_argument("--no-reachability-check", action="store_true",
                         help="do not ask a peer to dial this server back (a swarm on one machine, where every peer "
                              "can reach every other)")
    monitoring = serve.add_argument_group("monitoring")
    monitoring.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                            help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (tokens computed, "
                                 "requests by kind and error code, step latency, batch sizes, open sessions, cache "
                                 "room, queue depth); 0 picks a free port; the URL is printed at start (default: off)")
    monitoring.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                            help="address the metrics endpoint listens on (default: 127.0.0.1, this machine only; "
                                 "0.0.0.0 lets a Prometheus on another machine scrape it)")

    from .generate_command import add_generate_parser
    from .status_command import add_status_parser

    add_generate_parser(commands, add_network_flags)
    add_status_parser(commands, add_network_flags)
    from .api.command import add_api_parser

    add_api_parser(commands, add_network_flags)
    return parser


def _signal_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (each time one arrives: clear it to wait for the next)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event


async def _wait_for_signal() -> None:
    await _signal_event().wait()


async def _reachable_first(node) -> list[str]:
    """The peer's multiaddrs, loopback ones last (they are of use only on this machine)."""
    return sorted(await node.visible_maddrs(), key=lambda maddr: "/127." in maddr or "/ip6/::1/" in maddr)


async def run_dht(args: argparse.Namespace) -> int:
    from ..p2p import PeerNode

    node = await PeerNode.create(network_config(args, relay_for_others=not args.no_relay))
    try:
        maddrs = await _reachable_first(node)
        for maddr in maddrs:
            print(maddr, flush=True)
        if args.maddrs_file:
            Path(args.maddrs_file).write_text("".join(f"{maddr}\n" for maddr in maddrs))
        logger.info("Bootstrap peer %s is up; stop it with Ctrl-C", node.peer_id_str)
        await _wait_for_signal()
    finally:
        await node.shutdown()
    return 0


async def run_serve(args: argparse.Namespace) -> int:
    from .server.config import ServerConfig
    from .server.server import Server

    start, end = args.blocks or (None, None)
    config = ServerConfig(
        model=args.model, start=start, end=end, num_blocks=args.num_blocks,
        network=network_config(args, relay_for_others=not args.no_relay),
        device=args.device, dtype=args.dtype, cache_tokens=args.cache_tokens, session_timeout_s=args.session_timeout,
        max_batch_tokens=args.max_batch_tokens, max_batch_sessions=args.max_batch_sessions,
        max_step_tokens=args.max_step_tokens, max_length=args.max_length, max_batch=args.max_batch,
        max_sessions_per_peer=args.max_sessions_per_peer, max_frame_bytes=int(args.max_frame_mb * 2**20),
        throughput=args.throughput, quick_throughput=args.quick_throughput,
        check_reachability=not args.no_reachability_check, drain_timeout_s=args.drain_timeout,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host,
    )
    stop = _signal_event()
    starting = asyncio.ensure_future(Server.create(config))
    await asyncio.wait([starting, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # interrupted while loading: Server.create cleans up after itself
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return 0
    server = starting.result()
    try:
        for maddr in await _reachable_first(server.node):
            print(maddr, flush=True)
        print(server.reachability, flush=True)
        if server.metrics_endpoint is not None:
            print(f"metrics: {server.metrics_endpoint.url}", flush=True)
        print(f"online: serving {server.model_uid} blocks {server.start}:{server.end} as {server.node.peer_id_str}",
              flush=True)
        await stop.wait()
        stop.clear()
        logger.info("Draining (up to %.0f s; signal again to exit now)", config.drain_timeout_s)
        draining = asyncio.ensure_future(server.drain(config.drain_timeout_s))
        await asyncio.wait([draining, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        draining.cancel()
    finally:
        await server.shutdown()
    return 0


async def _quiet_about_lost_daemon(command: Awaitable[int]) -> int:
    """Run `command`; at exit, hivemind's tasks talking to a daemon that is already gone (killed with
    our process group) fail with connection errors: expected then, so logged at debug level."""
    loop = asyncio.get_running_loop()

    def handle(loop, context) -> None:
        exc = context.get("exception")
        if isinstance(exc, ConnectionError) or (isinstance(exc, RuntimeError) and "closed" in str(exc)):
            logger.debug("Ignored at exit: %s", context.get("message"))
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
    return await command


def _configure_logging(verbose: bool) -> None:
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not verbose:
        logging.getLogger("hivemind").setLevel(logging.WARNING)


def _exit_with_parent() -> None:
    """For children of a LocalSwarm: SIGTERM ourselves when the parent process is gone, however it
    died. (Polled: Linux's PR_SET_PDEATHSIG fires when the parent *thread* ends, which is wrong for
    a parent that starts peers from a worker thread.)"""
    parent = os.environ.pop(EXIT_WITH_PARENT_ENV, None)
    if parent is None:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="bloompeer-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    _exit_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    check_blocks_within_model(parser, args)
    _configure_logging(args.verbose)
    commands: dict[str, Callable[[argparse.Namespace], Awaitable[int]]] = {"dht": run_dht, "serve": run_serve}
    if args.command == "generate":
        from .generate_command import run_generate

        return run_generate(args)  # synchronous: the client runs its own event loop thread
    if args.command == "status":
        from .status_command import run_status

        return run_status(args)
    if args.command == "api":
        from .api.command import run_api

        return run_api(args, network_config(args, client_mode=True))  # synchronous: uvicorn runs its own loop
    import uvloop

    from ..p2p import BloompeerError

    try:
        return uvloop.run(_quiet_about_lost_daemon(commands[args.command](args)))
    except (BloompeerError, ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
