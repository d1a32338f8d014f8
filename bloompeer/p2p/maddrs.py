"""Multiaddr strings that peers tell each other (in DHT records): checked before anyone dials them.

Only the shapes bloompeer announces pass: an IP or DNS host, a TCP or UDP port (QUIC on UDP),
the peer's id, and for a relay's circuit `/p2p-circuit` after the relay's id. Anything else (other
protocols, ports outside 1..65535 or not plain ASCII digits, IPv6 zones, characters a shell or a log
would mind) is refused with a ProtocolError, and nothing else is raised, whatever the input.
"""

from __future__ import annotations

import ipaddress
import re

from .errors import ProtocolError

__all__ = ["MAX_MADDR_CHARS", "check_circuit_maddr", "check_peer_maddr", "check_plain_maddr", "peer_id_in"]

MAX_MADDR_CHARS = 256
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,128}")  # base58
_HOST_NAME = re.compile(r"[A-Za-z0-9.-]{1,253}")
_PORT = re.compile(r"[0-9]{1,5}")  # ASCII only: str.isdigit() and int() take other scripts' digits too


def _check_host(protocol: str, value: str) -> bool:
    if "%" in value:  # an IPv6 zone: meaningful on its sender's machine only, and free text
        return False
    try:
        if protocol == "ip4":
            return ipaddress.ip_address(value).version == 4
        if protocol == "ip6":
            return ipaddress.ip_address(value).version == 6
    except ValueError:
        return False
    return protocol in ("dns", "dns4", "dns6") and bool(_HOST_NAME.fullmatch(value))


def _is_port(text: str) -> bool:
    return bool(_PORT.fullmatch(text)) and 0 < int(text) < 65536


def _check_transport(parts: list[str]) -> list[str]:
    """The parts after host and port (`parts` starts at the transport); raises if it is not one we use."""
    if len(parts) < 2 or parts[0] not in ("tcp", "udp") or not _is_port(parts[1]):
        raise ProtocolError("a multiaddr needs a TCP or UDP port from 1 to 65535")
    rest = parts[2:]
    if parts[0] == "udp":
        if not rest or rest[0] != "quic-v1":
            raise ProtocolError("a UDP multiaddr must be QUIC (quic-v1)")
        rest = rest[1:]
    return rest


def peer_id_in(maddr: str) -> str:
    """The peer id of `/…/p2p/<id>` (the first one: for a circuit address, the relay's)."""
    parts = maddr.split("/")
    return parts[parts.index("p2p") + 1]


def _check_address(maddr: object) -> list[str]:
    """`/ip4|ip6|dns…/HOST/tcp/PORT` or `…/udp/PORT/quic-v1`, then what follows (split at "/")."""
    if not isinstance(maddr, str) or not 0 < len(maddr) <= MAX_MADDR_CHARS:
        raise ProtocolError(f"a multiaddr must be a string of at most {MAX_MADDR_CHARS} characters")
    parts = maddr.split("/")
    if len(parts) < 5 or parts[0] != "" or not _check_host(parts[1], parts[2]):
        raise ProtocolError(f"not a multiaddr with an IP or DNS host: {maddr[:80]!r}")
    return _check_transport(parts[3:])


def check_peer_maddr(maddr: object) -> str:
    """`/ip4|ip6|dns…/HOST/tcp/PORT[/…]/p2p/ID`: a peer's own dialable address."""
    rest = _check_address(maddr)
    if len(rest) != 2 or rest[0] != "p2p" or not _PEER_ID.fullmatch(rest[1]):
        raise ProtocolError(f"a multiaddr must end with /p2p/<peer id>: {maddr[:80]!r}")
    return maddr


def check_plain_maddr(maddr: object) -> str:
    """`/ip4|ip6|dns…/HOST/tcp/PORT` or `…/udp/PORT/quic-v1`: an address without the peer's id (a
    reachability check asks about these)."""
    if _check_address(maddr):
        raise ProtocolError(f"a plain multiaddr is a host and a port, nothing after: {maddr[:80]!r}")
    return maddr


def check_circuit_maddr(maddr: object) -> str:
    """`<a relay's address>/p2p-circuit`: where a peer behind NAT is reached through that relay."""
    if not isinstance(maddr, str) or not maddr.endswith("/p2p-circuit"):
        raise ProtocolError("a relayed multiaddr must end with /p2p-circuit")
    check_peer_maddr(maddr[: -len("/p2p-circuit")])
    return maddr
