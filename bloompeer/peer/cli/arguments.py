"""Argument types: each turns one flag's text into a value, or refuses it in words a user can act on.

argparse calls them while parsing, so a bad value ends the command (exit 2, one line) before
anything is imported or started. Nothing heavy is imported here.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from ...weight_format import QUANT_KINDS

__all__ = [
    "block_range", "device_argument", "fraction", "listen_address", "model_argument",
    "non_negative_float", "peer_address", "port", "positive_float", "positive_int", "probability", "quant_kinds",
]



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


def device_argument(text: str) -> str:
    """--device: cpu, cuda or cuda:N (whether this machine has it is checked when the server starts)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text} is not a device bloompeer computes on: cpu, cuda or cuda:N")
    return text


def peer_address(text: str) -> str:
    """--initial-peers: a peer's whole multiaddr, its /p2p/ id included (as `bloompeer dht` prints it)."""
    if not text.startswith("/") or "/p2p/" not in text or text.endswith("/p2p/"):
        raise argparse.ArgumentTypeError(f"{text} is not a peer's whole address: copy it as `bloompeer dht` or a "
                                         f"server printed it, e.g. /ip4/203.0.113.5/tcp/31337/p2p/Qm...")
    return text


def listen_address(text: str) -> str:
    """--host-maddrs, --announce-maddrs: a multiaddr (libp2p checks the rest when it starts)."""
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"{text} is not a multiaddr: one begins with /, e.g. /ip4/0.0.0.0/tcp/31337")
    return text


def block_range(text: str) -> tuple[int, int]:
    """--blocks A:B: blocks A..B-1."""
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a block range like 0:8") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"{text!r} is empty: it means blocks start..end-1, so start < end")
    return start, end


def _number(convert: Callable[[str], float], kind: str, accept: Callable[[float], bool], bounds: str):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"{text} is not {bounds}")
        return value

    return parse


fraction = _number(float, "a number", lambda value: 0.0 <= value <= 1.0, "between 0 and 1")
positive_int = _number(int, "a whole number", lambda value: value >= 1, "at least 1")
positive_float = _number(float, "a number", lambda value: value > 0, "more than 0")
non_negative_float = _number(float, "a number", lambda value: value >= 0, "0 or more")
port = _number(int, "a port number", lambda value: 0 <= value <= 65535, "a port number (0 to 65535)")
probability = _number(float, "a number", lambda value: 0.0 < value <= 1.0, "more than 0 and at most 1")


def quant_kinds(text: str) -> tuple[str, ...]:
    """--quant-allowed none,int8: the weight formats a client accepts."""
    kinds = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    unknown = [kind for kind in kinds if kind not in QUANT_KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {','.join(QUANT_KINDS)}, comma-separated")
    return kinds
