"""Flags shared by several commands, their checks, and how they become a NetworkConfig.

Kept free of torch, transformers and hivemind at import time, so that `bloompeer --help` and
every refusal of a bad argument answer before anything heavy is loaded or started. Commands
import this module; it imports none of them (nor `cli.py`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

__all__ = [
    "INITIAL_PEERS_ENV", "add_network_flags", "check_blocks_within_model", "fraction", "initial_peers",
    "model_argument", "network_config", "positive_int",
]

INITIAL_PEERS_ENV = "BLOOMPEER_INITIAL_PEERS"


def add_network_flags(parser: argparse.ArgumentParser, listen_default: str) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("network")
    group.add_argument("--initial-peers", nargs="+", metavar="MADDR", default=None,
                       help=f"multiaddrs of peers already in the swarm, e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm... "
                            f"(default: ${INITIAL_PEERS_ENV}, space-separated)")
    group.add_argument("--host-maddrs", nargs="+", metavar="MADDR", default=[listen_default],
                       help=f"where to listen (default: {listen_default})")
    group.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", default=[],
                       help="addresses to announce instead of the listening ones, e.g. a public IP and a "
                            "forwarded port: /ip4/203.0.113.5/tcp/31337")
    group.add_argument("--identity-path", metavar="FILE", default=None,
                       help="private key file that keeps this peer's id across restarts (created if missing)")
    return group


def initial_peers(args: argparse.Namespace) -> tuple[str, ...]:
    if args.initial_peers is not None:
        return tuple(args.initial_peers)
    return tuple(os.environ.get(INITIAL_PEERS_ENV, "").split())


def network_config(args: argparse.Namespace, client_mode: bool = False, relay_for_others: bool = False):
    from ..p2p import NetworkConfig

    return NetworkConfig(
        initial_peers=initial_peers(args), host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs), identity_path=args.identity_path, client_mode=client_mode,
        relay_for_others=relay_for_others,
    )


def model_argument(text: str) -> str:
    """--model: a checkpoint directory with a config.json, or a hub name (org/model), checked without loading it."""
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"{text} has no config.json: not a Hugging Face checkpoint directory")
        return text
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or not text:
        raise argparse.ArgumentTypeError(f"{text} is not a directory (and not a hub name like org/model)")
    return text


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def check_blocks_within_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--blocks A:B against a local checkpoint's number of blocks (a hub model is checked once its config is read)."""
    blocks = getattr(args, "blocks", None)
    config_file = Path(args.model).expanduser() / "config.json" if blocks is not None else None
    if config_file is None or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    num_blocks = config.get("n_layer", config.get("num_hidden_layers"))
    if isinstance(num_blocks, int) and blocks[1] > num_blocks:
        parser.error(f"--blocks {blocks[0]}:{blocks[1]} is not within the model's {num_blocks} blocks "
                     f"(0:{num_blocks}): {args.model}")
