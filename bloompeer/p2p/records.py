"""DHT records: which server serves which blocks of which model, and how well.

Key per block: "{model_uid}.{block_index}"; subkey: the owner's public key (so only that
server can write it, see `dht.py`); value: a ServerRecord map.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from .errors import ProtocolError

__all__ = ["RequestLimits", "ServerState", "ServerRecord", "block_key"]


class ServerState(str, Enum):
    JOINING = "joining"  # loading weights; not taking sessions yet
    ONLINE = "online"
    DRAINING = "draining"  # finishing its sessions, taking no new ones
    OFFLINE = "offline"


def block_key(model_uid: str, block_index: int) -> str:
    return f"{model_uid}.{block_index}"


@dataclass(frozen=True)
class RequestLimits:
    """The largest request a server takes, announced so that clients never route one it must refuse."""

    max_batch: int  # rows (sequences) per session or forward
    max_length: int  # tokens per session (prompt and output), or per sequence of a forward
    max_step_tokens: int  # rows (batch x tokens) in one request

    @classmethod
    def from_wire(cls, value: Any) -> RequestLimits:
        if not isinstance(value, dict) or set(value) != _LIMIT_FIELDS or not all(
                type(limit) is int and 0 < limit < 2**40 for limit in value.values()):
            raise ProtocolError(f"server record: limits must be a map of {sorted(_LIMIT_FIELDS)} to positive ints")
        return cls(**value)


@dataclass(frozen=True)
class ServerRecord:
    """One server's announcement for one of its blocks (the same record for every block of its span)."""

    peer_id: str  # base58
    state: ServerState
    start: int  # the server's whole span, half-open
    end: int
    throughput: float  # decode tokens per second through one block, as measured or configured (0: unknown)
    cache_tokens_left: int  # KV cache room left, in tokens (batch x length)
    dtype: str
    version: str  # bloompeer version
    weights_fingerprint: str
    relayed: bool  # reachable only through a libp2p relay
    limits: RequestLimits

    def to_wire(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value}

    @classmethod
    def from_wire(cls, value: Any) -> ServerRecord:
        if not isinstance(value, dict) or set(value) != _RECORD_FIELDS:
            raise ProtocolError("a server record is a map with exactly the fields of ServerRecord")
        checks = {
            "peer_id": lambda v: isinstance(v, str) and 0 < len(v) <= 128,
            "state": lambda v: isinstance(v, str) and v in _STATES,
            "start": lambda v: type(v) is int and v >= 0,
            "end": lambda v: type(v) is int and v > value["start"],  # start is checked first
            "throughput": lambda v: type(v) in (int, float) and math.isfinite(v) and v >= 0,
            "cache_tokens_left": lambda v: type(v) is int and v >= 0,
            "dtype": lambda v: isinstance(v, str) and len(v) <= 32,
            "version": lambda v: isinstance(v, str) and len(v) <= 64,
            "weights_fingerprint": lambda v: isinstance(v, str) and len(v) <= 128,
            "relayed": lambda v: type(v) is bool,
        }
        for name, check in checks.items():
            if not check(value[name]):
                raise ProtocolError(f"server record: bad {name} {str(value[name])[:40]!r}")
        return cls(**{**value, "state": ServerState(value["state"]), "throughput": float(value["throughput"]),
                      "limits": RequestLimits.from_wire(value["limits"])})


_RECORD_FIELDS = frozenset(ServerRecord.__dataclass_fields__)
_LIMIT_FIELDS = frozenset(RequestLimits.__dataclass_fields__)
_STATES = frozenset(state.value for state in ServerState)
