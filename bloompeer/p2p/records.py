"""DHT records: which server serves which blocks of which model, and how well.

Key per block: "{model_uid}.{block_index}"; subkey: the owner's public key (so only that
server can write it, see `dht.py`); value: a ServerRecord map.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from ..weight_format import DEVICE_KINDS, DTYPES, INT4_GROUP_SIZES, QUANT_KINDS, WeightFormat
from .errors import ProtocolError
from .maddrs import check_circuit_maddr, check_peer_maddr, peer_id_in

__all__ = ["MAX_PUSH_RTTS", "MAX_RELAY_MADDRS", "MAX_RTT_S", "RequestLimits", "ServerState", "ServerRecord", "block_key"]

MAX_PUSH_RTTS = 16  # servers a record may name round trips to (its nearest possible next hops)
MAX_RTT_S = 60.0
MAX_RELAY_MADDRS = 4  # addresses in relay_maddrs, and relays in via_relays


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
    # how it stores and computes its weights. On the wire: dtype, and quant, quant_group_size and
    # device, which records of versions before them lack (they stored none, on the CPU): those are
    # left out for none and for the CPU, so that such records read the same
    weights: WeightFormat
    version: str  # bloompeer version
    weights_fingerprint: str
    relayed: bool  # reachable only through a libp2p relay
    limits: RequestLimits
    # seconds of a round trip from this server to servers it could push a step to (peer id base58,
    # seconds), as this server measured them; left out on the wire when empty, so that records of
    # servers that measured nothing read the same as those of versions before the field
    push_rtts_s: tuple[tuple[str, float], ...] = ()
    # the model family its blocks compute as (blocks/families.py: "bloom", "llama"); records of
    # versions before the field were all BLOOM's
    family: str = "bloom"
    # this server relays for peers behind NAT: the addresses (ending /p2p/<its id>) they reserve on
    relay_maddrs: tuple[str, ...] = ()
    # this server is behind NAT: the relays' circuit addresses it is reached through now
    via_relays: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        wire = {**asdict(self), "state": self.state.value, "push_rtts_s": dict(self.push_rtts_s),
                "relay_maddrs": list(self.relay_maddrs), "via_relays": list(self.via_relays)}
        del wire["weights"]
        weights = self.weights
        wire["dtype"] = weights.dtype
        if weights.quantized:
            wire["quant"], wire["quant_group_size"] = weights.quant, weights.group_size
        if weights.device != "cpu":
            wire["device"] = weights.device
        for optional in ("push_rtts_s", "relay_maddrs", "via_relays"):  # left out when empty: reads as before them
            if not wire[optional]:
                del wire[optional]
        return wire

    def push_rtt_s(self, peer_id: str) -> float | None:
        """This server's measured round trip to `peer_id`, or None if it announced none."""
        return dict(self.push_rtts_s).get(peer_id)

    @classmethod
    def from_wire(cls, value: Any) -> ServerRecord:
        if not isinstance(value, dict) or not _REQUIRED_FIELDS <= set(value) <= _WIRE_FIELDS:
            raise ProtocolError(f"a server record is a map with the fields of ServerRecord "
                                f"({', '.join(sorted(_OPTIONAL_FIELDS))} optional)")
        checks = {
            "peer_id": lambda v: isinstance(v, str) and 0 < len(v) <= 128,
            "state": lambda v: isinstance(v, str) and v in _STATES,
            "start": lambda v: type(v) is int and v >= 0,
            "end": lambda v: type(v) is int and v > value["start"],  # start is checked first
            "throughput": lambda v: type(v) in (int, float) and math.isfinite(v) and v >= 0,
            "cache_tokens_left": lambda v: type(v) is int and v >= 0,
            "dtype": lambda v: isinstance(v, str) and v in DTYPES,
            "version": lambda v: isinstance(v, str) and len(v) <= 64,
            "weights_fingerprint": lambda v: isinstance(v, str) and len(v) <= 128,
            "relayed": lambda v: type(v) is bool,
            "family": lambda v: isinstance(v, str) and 0 < len(v) <= 32,
            "quant": lambda v: isinstance(v, str) and v in QUANT_KINDS,
            "device": lambda v: isinstance(v, str) and v in DEVICE_KINDS,
            "quant_group_size": lambda v: type(v) is int and (
                v in INT4_GROUP_SIZES if value["quant"] == "int4" else v == 0),  # quant is checked first
        }
        value = {"family": "bloom", "quant": "none", "quant_group_size": 0, "device": "cpu", **value}
        for name, check in checks.items():
            if not check(value[name]):
                raise ProtocolError(f"server record: bad {name} {str(value[name])[:40]!r}")
        weights = WeightFormat(*(value.pop(name) for name in _WEIGHT_FIELDS))
        return cls(**{**value, "weights": weights, "state": ServerState(value["state"]),
                      "throughput": float(value["throughput"]),
                      "limits": RequestLimits.from_wire(value["limits"]),
                      "push_rtts_s": _push_rtts_from_wire(value.get("push_rtts_s", {})),
                      "relay_maddrs": _maddrs_from_wire(value.get("relay_maddrs", []), "relay_maddrs",
                                                        lambda m: _own_maddr(m, value["peer_id"])),
                      "via_relays": _maddrs_from_wire(value.get("via_relays", []), "via_relays",
                                                      check_circuit_maddr)})


def _own_maddr(maddr: object, peer_id: str) -> str:
    if peer_id_in(check_peer_maddr(maddr)) != peer_id:
        raise ProtocolError("server record: relay_maddrs must be the server's own addresses")
    return maddr


def _maddrs_from_wire(value: Any, name: str, check) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_RELAY_MADDRS:
        raise ProtocolError(f"server record: {name} must be a list of at most {MAX_RELAY_MADDRS} multiaddrs")
    try:
        return tuple(check(maddr) for maddr in value)
    except ProtocolError as exc:
        raise ProtocolError(f"server record: bad {name}: {exc}") from None


def _push_rtts_from_wire(value: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, dict) or len(value) > MAX_PUSH_RTTS or not all(
            isinstance(peer, str) and 0 < len(peer) <= 128 and type(rtt) in (int, float) and 0 <= rtt <= MAX_RTT_S
            for peer, rtt in value.items()):
        raise ProtocolError(f"server record: push_rtts_s must map at most {MAX_PUSH_RTTS} peer ids to seconds "
                            f"between 0 and {MAX_RTT_S:.0f}")
    return tuple(sorted((peer, float(rtt)) for peer, rtt in value.items()))


_WEIGHT_FIELDS = ("quant", "quant_group_size", "dtype", "device")  # WeightFormat's fields, in its order, on the wire
_WIRE_FIELDS = frozenset(ServerRecord.__dataclass_fields__) - {"weights"} | set(_WEIGHT_FIELDS)
_OPTIONAL_FIELDS = frozenset({"push_rtts_s", "family", "quant", "quant_group_size", "device", "relay_maddrs",
                              "via_relays"})
_REQUIRED_FIELDS = _WIRE_FIELDS - _OPTIONAL_FIELDS
_LIMIT_FIELDS = frozenset(RequestLimits.__dataclass_fields__)
_STATES = frozenset(state.value for state in ServerState)
