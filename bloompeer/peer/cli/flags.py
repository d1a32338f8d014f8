"""Every flag that reaches a frozen config, and the one mapping from parsed flags to NetworkConfig,
ServerConfig and ClientConfig.

A flag is defined here next to the line that puts it into its config, so adding one is a change
to one file. Kept free of torch, transformers and hivemind at import time, so that `--help` and
every refusal of a bad argument answer before anything heavy is loaded or started. Commands
import this module; it imports none of them (nor `cli.py`).
"""

from __future__ import annotations

import argparse
import os

from ...weight_format import DTYPES, INT4_GROUP_SIZES, QUANT_KINDS
from .arguments import (
    block_range, device_argument, fraction, listen_address, model_argument, non_negative_float, peer_address, port,
    positive_float, positive_int, quant_kinds,
)
from .default_model import DEMO_MODEL_DIR
from .local_config import local_num_model_blocks

__all__ = [
    "INITIAL_PEERS_ENV", "add_client_flags", "add_model_flag", "add_network_flags", "add_server_flags",
    "check_arguments", "client_config", "initial_peers", "network_config", "server_config",
]

INITIAL_PEERS_ENV = "BLOOMPEER_INITIAL_PEERS"


def add_model_flag(parser: argparse.ArgumentParser, use: str = "") -> None:
    parser.add_argument("--model", default=str(DEMO_MODEL_DIR), type=model_argument,
                        help="local checkpoint directory or Hugging Face hub name (default: the bundled demo model, "
                             f"a small BLOOM trained on Jane Austen's novels){use}")


def add_network_flags(parser: argparse.ArgumentParser, listen_default: str) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("network")
    group.add_argument("--initial-peers", nargs="+", metavar="MADDR", default=None, type=peer_address,
                       help=f"multiaddrs of peers already in the swarm, e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm... "
                            f"(default: ${INITIAL_PEERS_ENV}, space-separated)")
    group.add_argument("--host-maddrs", nargs="+", metavar="MADDR", default=[listen_default],
                       type=listen_address, help=f"where to listen (default: {listen_default})")
    group.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", default=[], type=listen_address,
                       help="addresses to announce instead of the listening ones, e.g. a public IP and a "
                            "forwarded port: /ip4/203.0.113.5/tcp/31337")
    group.add_argument("--identity-path", metavar="FILE", default=None,
                       help="private key file that keeps this peer's id across restarts (created if missing)")
    return group


def initial_peers(args: argparse.Namespace) -> tuple[str, ...]:
    if args.initial_peers is not None:
        return tuple(args.initial_peers)
    return tuple(os.environ.get(INITIAL_PEERS_ENV, "").split())


def network_config(args: argparse.Namespace, client_mode: bool = False, relay_for_others: bool = False,
                   peers: tuple[str, ...] | None = None):
    """peers: the initial peers to use instead of the flags' (a local swarm's)."""
    from ...p2p import NetworkConfig

    return NetworkConfig(
        initial_peers=initial_peers(args) if peers is None else peers, host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs), identity_path=args.identity_path, client_mode=client_mode,
        relay_for_others=relay_for_others,
    )


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """What `serve` is told: which blocks, where to compute, its limits, network and monitoring."""
    from ..server.config import ServerConfig

    defaults = ServerConfig(model="", start=None, end=None)
    add_model_flag(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--blocks", type=block_range, metavar="A:B", help="serve blocks A..B-1, e.g. 0:8")
    which.add_argument("--num-blocks", type=positive_int, metavar="K", nargs="?", const=0,
                       help="serve K consecutive blocks where the swarm is weakest, and move to others when the "
                            "swarm needs them more (servers left or died): it looks every 10 s or so. Without K: "
                            "as many blocks as the memory plan fits (counting --quant)")
    parser.add_argument("--device", default="cpu", type=device_argument,
                        help="where the blocks compute: cpu, cuda (the first GPU) or cuda:N (default: cpu)")
    parser.add_argument("--dtype", default=defaults.dtype, choices=DTYPES,
                        help=f"compute and cache dtype (default: {defaults.dtype})")
    parser.add_argument("--quant", default=defaults.quant, choices=QUANT_KINDS,
                        help="store the blocks' linear weights as int8 (one scale per output channel, about 0.26x "
                             "float32's bytes) or 4-bit (groups of --quant-group-size inputs, about 0.14x), quantized "
                             "as each block loads and computed by PyTorch's own kernels (int8: inputs rounded to int8 "
                             "on the CPU, kept in --dtype on CUDA; 4-bit: bfloat16 inputs); faster decode "
                             "steps on the CPU, more blocks but not more speed on a GPU; outputs close to float's "
                             "but not equal (clients may refuse them with --quant-allowed). Norms, biases and the "
                             "cache stay in --dtype (default: none)")
    parser.add_argument("--quant-group-size", type=int, default=defaults.quant_group_size,
                        choices=INT4_GROUP_SIZES, metavar="N",
                        help=f"inputs per 4-bit group, one of {', '.join(map(str, INT4_GROUP_SIZES))}: smaller is "
                             f"closer to float and a little larger ({defaults.quant_group_size})")
    group = parser.add_argument_group("capacity and limits (what one server gives its clients)")
    group.add_argument("--cache-tokens", type=positive_int, default=None, metavar="N",
                       help="attention cache for all sessions together, in tokens over the served blocks; a new "
                            "session reserves batch x max_length of it (default: half the memory left once the blocks are loaded, "
                            "counting a container's limit; 80%% of a GPU's)")
    group.add_argument("--session-timeout", type=positive_float, default=defaults.session_timeout_s,
                       metavar="SECONDS",
                       help=f"close a session after this long without a step ({defaults.session_timeout_s:.0f})")
    group.add_argument("--max-batch-tokens", type=positive_int, default=defaults.max_batch_tokens, metavar="N",
                       help="rows (batch x tokens) computed in one pass; sessions' steps are batched up to it and "
                            f"longer prompts run in chunks ({defaults.max_batch_tokens})")
    group.add_argument("--max-batch-sessions", type=positive_int, default=None, metavar="N",
                       help="at most N sessions' steps share one pass (default: as many as fit in "
                            "--max-batch-tokens); 1 turns batching across sessions off (batched passes use the same "
                            "weights, no copy)")
    group.add_argument("--batch-wait", type=non_negative_float, default=defaults.batch_wait_s, metavar="SECONDS",
                       help="before a pass of inference steps, wait up to this long for it to fill (--max-batch-"
                            "sessions steps, or --max-batch-tokens rows): fewer, fuller passes at the cost of each "
                            "step's latency (default 0: a pass waits only, briefly, for the sessions of the last one)")
    group.add_argument("--max-step-tokens", type=positive_int, default=defaults.max_step_tokens, metavar="N",
                       help=f"rows (batch x tokens) one request may send ({defaults.max_step_tokens})")
    group.add_argument("--max-batch", type=positive_int, default=defaults.max_batch, metavar="N",
                       help=f"sequences (rows) one session or forward may have ({defaults.max_batch})")
    group.add_argument("--max-length", type=positive_int, default=defaults.max_length, metavar="N",
                       help=f"tokens one session may hold, prompt and output ({defaults.max_length})")
    group.add_argument("--max-sessions-per-peer", type=positive_int, default=defaults.max_sessions_per_peer,
                       metavar="N", help=f"sessions one client may have open at once ({defaults.max_sessions_per_peer})")
    group.add_argument("--max-frame-mb", type=positive_float, default=defaults.max_frame_bytes / 2**20, metavar="MB",
                       help=f"largest frame accepted ({defaults.max_frame_bytes / 2**20:.0f} MiB)")
    group.add_argument("--throughput", type=positive_float, default=None, metavar="TOKENS_PER_S",
                       help="announce this decode throughput (tokens/s through one block) instead of measuring it "
                            "at start (measured once per model, device and dtype, then kept in the cache directory)")
    group.add_argument("--quick-throughput", action="store_true",
                       help="estimate the throughput from a few steps and keep it nowhere (for a swarm that lives "
                            "for one command; `generate` starts its local swarm so)")
    group.add_argument("--drain-timeout", type=non_negative_float, default=defaults.drain_timeout_s, metavar="SECONDS",
                       help="on SIGTERM or Ctrl-C, how long open sessions get to move elsewhere before the server "
                            f"exits ({defaults.drain_timeout_s:.0f}); a second signal exits at once")
    network = add_network_flags(parser, "/ip4/0.0.0.0/tcp/0")
    network.add_argument("--no-relay", action="store_true",
                         help="do not relay traffic for peers behind NAT (by default a directly reachable server "
                              "relays for them, up to 16 GiB and 24 h per connection). A server that cannot be "
                              "reached itself is served through its --initial-peers in any case")
    network.add_argument("--no-reachability-check", action="store_true",
                         help="do not ask a peer to dial this server back (a swarm on one machine, where every peer "
                              "can reach every other)")
    monitoring = parser.add_argument_group("monitoring")
    monitoring.add_argument("--metrics-port", type=port, default=None, metavar="PORT",
                            help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (tokens computed, "
                                 "requests by kind and error code, step latency, batch sizes, open sessions, cache "
                                 "room, queue depth); 0 picks a free port; the URL is printed at start (default: off)")
    monitoring.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                            help="address the metrics endpoint listens on (default: 127.0.0.1, this machine only; "
                                 "0.0.0.0 lets a Prometheus on another machine scrape it)")


def server_config(args: argparse.Namespace):
    from ..server.config import ServerConfig

    start, end = args.blocks or (None, None)
    return ServerConfig(
        model=args.model, start=start, end=end, num_blocks_to_serve=args.num_blocks,
        network=network_config(args, relay_for_others=not args.no_relay),
        device=args.device, dtype=args.dtype, quant=args.quant, quant_group_size=args.quant_group_size,
        cache_tokens=args.cache_tokens, session_timeout_s=args.session_timeout,
        max_batch_tokens=args.max_batch_tokens, max_batch_sessions=args.max_batch_sessions,
        batch_wait_s=args.batch_wait,
        max_step_tokens=args.max_step_tokens, max_length=args.max_length, max_batch=args.max_batch,
        max_sessions_per_peer=args.max_sessions_per_peer, max_frame_bytes=int(args.max_frame_mb * 2**20),
        throughput=args.throughput, quick_throughput=args.quick_throughput,
        check_reachability=not args.no_reachability_check, drain_timeout_s=args.drain_timeout,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host,
    )


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """What a client command (generate, api) is told about using the swarm."""
    parser.add_argument("--timeout", type=positive_float, default=60.0, metavar="SECONDS",
                        help="how long to wait for servers of missing blocks before giving up (60)")
    parser.add_argument("--push", action=argparse.BooleanOptionalAction, default=None,
                        help="have each server pass its output straight to the next one (one trip along the chain "
                             "per token instead of a round trip per server), or not (--no-push). Default: the "
                             "client chooses with each route, from the round trips it measures to the servers "
                             "and those the servers announce between them: push where that saves time (servers "
                             "far apart), not on one machine")
    trust = parser.add_argument_group("trust")
    trust.add_argument("--verify-fraction", type=fraction, default=0.0, metavar="F",
                       help="recompute this fraction of each span's steps on another server (or locally, with a "
                            "local checkpoint) and ban servers whose outputs disagree (0: off; 1: every step)")
    trust.add_argument("--trusted-servers", nargs="+", default=(), metavar="PEER_ID",
                       help="use only these servers (peer ids, as `bloompeer status` and the servers print them)")
    trust.add_argument("--quant-allowed", type=quant_kinds, default=QUANT_KINDS, metavar="KINDS",
                       help="use only servers storing their weights in one of these ways, comma-separated among "
                            "none,int8,int4 (default: all); `none` alone for exact results (float weights, computed in "
                            "the client's own dtype)")
    add_network_flags(parser, "/ip4/127.0.0.1/tcp/0")


def client_config(args: argparse.Namespace, peers: tuple[str, ...] | None = None):
    """peers: the initial peers to use instead of the flags' (a local swarm's)."""
    from ..client.config import ClientConfig

    return ClientConfig(network=network_config(args, client_mode=True, peers=peers),
                        missing_blocks_timeout_s=args.timeout, push=args.push,
                        verify_fraction=args.verify_fraction, trusted_servers=tuple(args.trusted_servers),
                        quant_allowed=args.quant_allowed)


def add_api_access_flags(parser: argparse.ArgumentParser) -> None:
    """Who may use `bloompeer api`."""
    access = parser.add_argument_group("access")
    access.add_argument("--api-key", action="append", default=None, metavar="KEY", type=_api_key,
                        help="require this key on every /v1 request, as 'Authorization: Bearer KEY' (the openai "
                             "client's api_key); repeat for several keys. Default: $BLOOMPEER_API_KEY if set, else "
                             "no key (then anyone who reaches the port may use the API)")
    access.add_argument("--public-dashboard", action="store_true",
                        help="serve the dashboard (/ and /api/swarm) and /metrics without a key (by default they "
                             "need one too; a browser asks for it as the password, any user name)")


def _api_key(text: str) -> str:
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError("an API key cannot be empty or start or end with spaces")
    return text


def api_access(args: argparse.Namespace):
    """--api-key (or $BLOOMPEER_API_KEY) and --public-dashboard as the API's access rule."""
    from ..api.auth import ApiAccess

    keys = args.api_key or ([os.environ["BLOOMPEER_API_KEY"]] if os.environ.get("BLOOMPEER_API_KEY") else [])
    return ApiAccess(keys=frozenset(keys), public_dashboard=args.public_dashboard)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check one flag at a time, before anything starts."""
    _check_blocks_within_model(parser, args)
    if hasattr(args, "initial_peers") and args.initial_peers is None:  # $BLOOMPEER_INITIAL_PEERS: argparse's unseen
        for address in initial_peers(args):
            try:
                peer_address(address)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"${INITIAL_PEERS_ENV}: {exc}")
    if getattr(args, "needs_initial_peers", False) and not initial_peers(args):
        parser.error(f"there is no swarm to ask: pass --initial-peers MADDR (an address that `bloompeer dht` or a "
                     f"server printed), or set ${INITIAL_PEERS_ENV}")


def _check_blocks_within_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--blocks A:B and --num-blocks K against a local checkpoint's number of blocks (a hub model is
    checked once its config is read)."""
    blocks, count = getattr(args, "blocks", None), getattr(args, "num_blocks", None)
    num_model_blocks = local_num_model_blocks(args.model) if blocks or count else None
    if num_model_blocks is None:
        return
    if blocks is not None and blocks[1] > num_model_blocks:
        parser.error(f"--blocks {blocks[0]}:{blocks[1]} is not within the model's {num_model_blocks} blocks "
                     f"(0:{num_model_blocks}): {args.model}")
    if count is not None and count > num_model_blocks:
        parser.error(f"--num-blocks {count} is more than the model's {num_model_blocks} blocks: {args.model}")
